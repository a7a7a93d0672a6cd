"""Indexing: ``__getitem__`` (basic and advanced), ``gather`` and ``index_select``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioautograd as ag
from tests.helpers import assert_close
from tests.ops.oracle import check_against_torch


def _randn(*shape: int, device: str = "cpu", requires_grad: bool = True) -> ag.Tensor:
    return ag.randn(*shape, dtype="float64", device=device, requires_grad=requires_grad)


def _array(*shape: int, seed: int = 0) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).standard_normal(shape)


def _long(values: Any, device: str = "cpu") -> ag.Tensor:
    return ag.tensor(values, dtype="int64", device=device)


# ----------------------------------------------------------------------- basic indexing

BASIC = [
    1,
    -1,
    (0, 2),
    (-1, -1, -1),
    slice(1, None),
    (slice(None), 1),
    (slice(None, None, -1), slice(0, 3, 2)),
    (Ellipsis, 0),
    (0, Ellipsis, slice(1, 3)),
    (None, 1, None),
    (slice(None), None, -2),
    (),
    Ellipsis,
    np.int64(1),
]


@pytest.mark.parametrize("index", BASIC, ids=repr)
async def test_basic_index_is_a_view_with_correct_grad(index: Any, device: str) -> None:
    x = _randn(2, 3, 4, device=device)
    y = x[index]
    expected = np.asarray(x.detach().cpu().data[index])
    assert y.shape == expected.shape
    assert_close(y, expected)
    assert y.grad_fn is not None
    assert y.grad_fn.name() == "GetItemBackward0"
    assert y._version_counter is x._version_counter
    assert await ag.gradcheck(lambda t: t[index], (x,))


async def test_integer_index_of_a_vector_gives_a_0d_view() -> None:
    x = _randn(3)
    y = x[1]
    assert y.shape == ()
    assert isinstance(y.data, np.ndarray)
    assert np.shares_memory(y.data, x.data)
    await (y * 3.0).backward()
    assert x.grad is not None
    assert_close(x.grad, [0.0, 3.0, 0.0])


async def test_basic_index_second_derivative() -> None:
    x = _randn(2, 3)
    assert await ag.gradgradcheck(lambda t: t[1, ::-1] * t[0], (x,))


async def test_basic_index_matches_torch(torch: Any) -> None:
    await check_against_torch(
        torch,
        lambda lib, t: (t[1], t[:, -1], t[..., 1:3], t[None, 0, :, None], t[-1, -1, -1]),
        _array(2, 3, 4),
    )


def test_index_out_of_range() -> None:
    with pytest.raises(IndexError):
        _randn(2, 3)[2]


# -------------------------------------------------------------------- advanced indexing


def _advanced_indices() -> list[Any]:
    return [
        [0, 1, 0],
        np.array([1, 1, 1]),
        _long([[0, 1], [1, 0]]),
        _long(1),
        [],
        (slice(None), [0, 0, 2]),
        (_long([0, 1, 1]), _long([2, 2, 0])),
        (Ellipsis, [3, 3]),
        (None, [1, 0]),
        ([1, 0], slice(None), [3, 0]),
        (0, [2, 2, 1]),
        np.array([True, False]),
        (slice(None), [True, False, True]),
        ag.tensor(np.arange(24).reshape(2, 3, 4) % 3 == 0),
    ]


@pytest.mark.parametrize("index", _advanced_indices(), ids=repr)
async def test_advanced_index_values_and_grad(index: Any) -> None:
    x = _randn(2, 3, 4)

    def as_numpy(item: Any) -> Any:
        if isinstance(item, ag.Tensor):
            return item.data
        if isinstance(item, tuple):
            return tuple(as_numpy(i) for i in item)
        return item

    y = x[index]
    expected = x.detach().data[as_numpy(index)]
    assert_close(y, expected)
    assert y.shape == expected.shape
    assert y.grad_fn is not None
    assert y.grad_fn.name() == "IndexBackward0"
    assert not np.shares_memory(y.data, x.data)
    if y.numel():
        assert await ag.gradcheck(lambda t: t[index], (x,))


async def test_repeated_indices_accumulate_gradient(device: str) -> None:
    x = _randn(4, device=device)
    y = x[_long([0, 2, 0, 0, 3], device=device)]
    await (
        (y * ag.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype="float64", device=device)).sum().backward()
    )
    assert x.grad is not None
    assert_close(x.grad, [1.0 + 3.0 + 4.0, 0.0, 2.0, 5.0])


async def test_repeated_indices_in_two_dims_accumulate() -> None:
    x = _randn(2, 3)
    y = x[[1, 1, 0], [2, 2, 2]]
    await y.sum().backward()
    assert x.grad is not None
    assert_close(x.grad, [[0.0, 0.0, 1.0], [0.0, 0.0, 2.0]])


async def test_boolean_mask_gradient() -> None:
    x = _randn(2, 3)
    mask = x.detach() > 0
    y = x[mask]
    assert_close(y, x.detach().data[x.detach().data > 0])
    await (y * 2.0).sum().backward()
    assert x.grad is not None
    assert_close(x.grad, np.where(x.detach().data > 0, 2.0, 0.0))


async def test_advanced_index_second_derivative() -> None:
    x = _randn(2, 3)
    index = ([0, 1, 1], [2, 0, 0])
    assert await ag.gradgradcheck(lambda t: t[index] ** 2, (x,))
    assert await ag.gradgradcheck(lambda t: t[:, [True, False, True]] ** 3, (x,))


async def test_advanced_index_matches_torch(torch: Any) -> None:
    def fn(lib: Any, t: Any) -> Any:
        index = lib.tensor([[0, 1], [1, 1]])
        return (
            t[[0, 0, 1]],
            t[:, [2, 2, 0]],
            t[index],
            t[..., [3, 3]],
            t[[1, 0], :, [3, 0]],
            t[t > 0],
            t[None, [1, 1]],
        )

    await check_against_torch(torch, fn, _array(2, 3, 4))


def test_index_with_float_tensor_raises() -> None:
    x = _randn(3)
    with pytest.raises(IndexError):
        x[ag.tensor([0.5])]


# ------------------------------------------------------------------------------- gather


def _gather_reference(x: np.ndarray[Any, Any], dim: int, index: np.ndarray[Any, Any]) -> Any:
    out = np.empty(index.shape)
    for position in np.ndindex(*index.shape):
        source = list(position)
        source[dim] = index[position]
        out[position] = x[tuple(source)]
    return out


@pytest.mark.parametrize(
    ("shape", "dim", "index"),
    [
        ((3, 4), 0, [[0, 1, 1, 0], [1, 1, 0, 0]]),
        ((3, 4), 1, [[0, 0], [3, 1], [2, 2]]),
        ((3, 4), -1, [[3], [0], [1]]),
        ((3, 4), -2, [[2, 0, 1, 1]]),
        ((2, 5), 1, [[1, 1, 1, 1, 1]]),
        ((2, 2, 3), 2, [[[0, 2]], [[1, 1]]]),
    ],
)
async def test_gather_values_and_grad(
    shape: tuple[int, ...], dim: int, index: list[Any], device: str
) -> None:
    x = _randn(*shape, device=device)
    idx = _long(index, device=device)
    y = ag.gather(x, dim, idx)
    assert y.shape == idx.shape
    assert_close(y, _gather_reference(x.detach().cpu().data, dim, np.array(index)))
    assert y.grad_fn is not None
    assert y.grad_fn.name() == "GatherBackward0"
    assert await ag.gradcheck(lambda t: t.gather(dim, idx), (x,))


async def test_gather_repeated_indices_accumulate() -> None:
    x = _randn(2, 3)
    idx = _long([[1, 1, 1], [0, 2, 2]])
    await x.gather(1, idx).sum().backward()
    assert x.grad is not None
    assert_close(x.grad, [[0.0, 3.0, 0.0], [1.0, 0.0, 2.0]])


async def test_gather_second_derivative() -> None:
    x = _randn(2, 3)
    idx = _long([[2, 2], [0, 1]])
    assert await ag.gradgradcheck(lambda t: t.gather(1, idx) ** 2, (x,))


async def test_gather_backward_is_differentiable_scatter_add() -> None:
    x = _randn(2, 3)
    idx = _long([[2, 2], [0, 1]])
    weight = ag.tensor([[1.0, 2.0], [3.0, 4.0]], dtype="float64", requires_grad=True)
    (grad_x,) = await ag.grad((x.gather(1, idx) * weight).sum(), [x], create_graph=True)
    assert grad_x.grad_fn is not None
    assert grad_x.grad_fn.name() == "ScatterAddBackward0"
    assert_close(grad_x, [[0.0, 0.0, 3.0], [3.0, 4.0, 0.0]])
    # d/d weight of sum(grad_x * c) = gather(c, 1, idx)
    c = np.arange(6.0).reshape(2, 3)
    (grad_weight,) = await ag.grad((grad_x * c).sum(), [weight])
    assert_close(grad_weight, np.take_along_axis(c, idx.data, axis=1))


async def test_gather_of_0d_tensor() -> None:
    x = ag.tensor(2.5, dtype="float64", requires_grad=True)
    y = ag.gather(x, 0, _long(0))
    assert y.shape == ()
    assert_close(y, 2.5)
    assert await ag.gradcheck(lambda t: ag.gather(t, -1, _long(0)), (x,))


async def test_gather_matches_torch(torch: Any) -> None:
    index = np.array([[0, 0], [3, 1], [2, 2]])
    await check_against_torch(
        torch, lambda lib, t: t.gather(1, lib.tensor(index)) * 2.0, _array(3, 4)
    )
    await check_against_torch(
        torch, lambda lib, t: lib.gather(t, 0, lib.tensor([[2, 2, 2, 0]])), _array(3, 4)
    )


def test_gather_errors() -> None:
    x = _randn(2, 3)
    with pytest.raises(RuntimeError, match="same number of dimensions"):
        x.gather(1, _long([0, 1]))
    with pytest.raises(RuntimeError, match="Expected dtype int64"):
        x.gather(1, ag.tensor([[0.0]]))
    with pytest.raises(RuntimeError, match="Size does not match at dimension 0"):
        x.gather(1, _long([[0], [1], [0]]))
    with pytest.raises(IndexError, match="Dimension out of range"):
        x.gather(2, _long([[0]]))


# ------------------------------------------------------------------------- index_select


@pytest.mark.parametrize(
    ("dim", "index"), [(0, [2, 0]), (1, [3, 3, 0, 3]), (-1, [1]), (-2, []), (0, 1)]
)
async def test_index_select_values_and_grad(dim: int, index: Any, device: str) -> None:
    x = _randn(3, 4, device=device)
    idx = _long(index, device=device)
    y = ag.index_select(x, dim, idx)
    assert_close(y, np.take(x.detach().cpu().data, np.atleast_1d(index).astype(int), axis=dim))
    assert y.grad_fn is not None
    assert y.grad_fn.name() == "IndexSelectBackward0"
    if y.numel():
        assert await ag.gradcheck(lambda t: t.index_select(dim, idx), (x,))


async def test_index_select_repeated_indices_accumulate() -> None:
    x = _randn(3, 2)
    await x.index_select(0, _long([2, 2, 0, 2])).sum().backward()
    assert x.grad is not None
    assert_close(x.grad, [[1.0, 1.0], [0.0, 0.0], [3.0, 3.0]])


async def test_index_select_second_derivative() -> None:
    x = _randn(3, 2)
    idx = _long([1, 1, 2])
    assert await ag.gradgradcheck(lambda t: t.index_select(0, idx) ** 2, (x,))


async def test_index_select_of_0d_tensor() -> None:
    x = ag.tensor(1.5, dtype="float64", requires_grad=True)
    y = ag.index_select(x, 0, _long([0]))
    assert y.shape == ()
    assert await ag.gradcheck(lambda t: ag.index_select(t, 0, _long(0)), (x,))


async def test_index_select_matches_torch(torch: Any) -> None:
    await check_against_torch(
        torch, lambda lib, t: t.index_select(-1, lib.tensor([3, 3, 0])), _array(2, 4)
    )
    await check_against_torch(
        torch, lambda lib, t: lib.index_select(t, 0, lib.tensor(1)), _array(2, 4)
    )


def test_index_select_errors() -> None:
    x = _randn(3, 4)
    with pytest.raises(IndexError, match="supposed to be a vector"):
        x.index_select(0, _long([[0]]))
    with pytest.raises(RuntimeError, match="Expected dtype int64"):
        x.index_select(0, ag.tensor([0.0]))


def test_cpu_indexing_never_imports_cupy() -> None:
    script = (
        "import sys, asyncio\n"
        "import aioautograd as ag\n"
        "x = ag.randn(3, 4, dtype='float64', requires_grad=True)\n"
        "y = x[[0, 0]].sum() + x.gather(1, ag.tensor([[1], [1], [0]])).sum()\n"
        "y = y + x.index_select(0, ag.tensor([2, 2])).sum()\n"
        "asyncio.run(y.backward())\n"
        "assert x.grad is not None\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'cupyx')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.stdout.strip() == "[]"
