"""``x[index] = value`` with autograd, and bounds checks of integer indices."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import aioautograd as ag
from tests.helpers import assert_close
from tests.ops.oracle import check_against_torch


def _array(*shape: int, seed: int = 0) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).standard_normal(shape)


def _randn(*shape: int, device: str = "cpu") -> ag.Tensor:
    return ag.randn(*shape, dtype="float64", device=device, requires_grad=True)


def _index(lib: Any, values: list[int]) -> Any:
    return lib.tensor(values, dtype=lib.int64)


# (index, shape of the value) pairs: basic and advanced, with broadcasting values.
CASES = {
    "row": (lambda lib: 1, (4,)),
    "row_broadcast": (lambda lib: 1, (1,)),
    "slice_scalar_shape": (lambda lib: (slice(None), 2), ()),
    "block": (lambda lib: (slice(0, 2), slice(1, 3)), (2, 2)),
    "block_broadcast": (lambda lib: (slice(0, 2), slice(1, 3)), (2, 1)),
    "ellipsis": (lambda lib: (Ellipsis, 0), (3,)),
    "int_tensor": (lambda lib: _index(lib, [0, 2]), (2, 4)),
    "int_tensor_broadcast": (lambda lib: _index(lib, [2, 0]), (4,)),
    "negative_int_tensor": (lambda lib: _index(lib, [-1]), (1, 4)),
    "mixed": (lambda lib: (slice(None), _index(lib, [1, 3])), (3, 2)),
    "bool_mask": (lambda lib: lib.tensor([True, False, True]), (2, 4)),
}


def _assign(index: Any) -> Any:
    def fn(lib: Any, x: Any, value: Any) -> Any:
        y = x * 2
        y[index(lib)] = value
        return y * y

    return fn


@pytest.mark.parametrize(("index", "value_shape"), CASES.values(), ids=CASES.keys())
async def test_setitem_gradients_match_finite_differences(
    index: Any, value_shape: tuple[int, ...], device: str
) -> None:
    x = _randn(3, 4, device=device)
    value = _randn(*value_shape, device=device)
    assign = _assign(index)

    def fn(t: ag.Tensor, v: ag.Tensor) -> ag.Tensor:
        moved = index(ag)
        if isinstance(moved, ag.Tensor):
            moved = moved.to(device)
        y = t * 2
        y[moved] = v
        return y * y

    assert await ag.gradcheck(fn, (x, value))
    if device == "cpu":
        assert await ag.gradgradcheck(lambda t, v: assign(ag, t, v), (x, value))


@pytest.mark.parametrize(("index", "value_shape"), CASES.values(), ids=CASES.keys())
async def test_setitem_matches_torch(index: Any, value_shape: tuple[int, ...], torch: Any) -> None:
    await check_against_torch(torch, _assign(index), _array(3, 4), _array(*value_shape, seed=1))


async def test_setitem_node_names_follow_pytorch(torch: Any) -> None:
    x = _randn(3)
    y = x * 1
    y[1:] = 5.0
    assert y.grad_fn.name() == "CopySlices"
    y[ag.tensor([0])] = 1.0
    assert y.grad_fn.name() == "IndexPutInplaceBackward0"
    await y.sum().backward()
    assert_close(x.grad, [0.0, 0.0, 0.0])


async def test_setitem_of_a_scalar_keeps_dtype_and_bumps_version() -> None:
    y = ag.zeros(2, 3)
    version = y._version
    y[0, 1] = 7
    y[ag.tensor([1]), ag.tensor([2])] = 2.5
    assert y.dtype == np.float32
    assert y._version == version + 2
    assert_close(y, [[0, 7, 0], [0, 0, 2.5]])


async def test_setitem_on_a_leaf_requires_no_grad_mode() -> None:
    w = ag.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="a view of a leaf Variable that requires grad"):
        w[0] = 0.0
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        w[ag.tensor([0])] = 0.0
    with ag.no_grad():
        w[0] = 0.0
        w[ag.tensor([2])] = 5.0
    assert w.is_leaf
    assert w.grad_fn is None
    assert_close(w.detach(), [0.0, 1.0, 5.0])
    await (w * 2).sum().backward()
    assert_close(w.grad, [2.0, 2.0, 2.0])


class ZeroFirst(ag.Function):
    """Zeroes the first element of its input gradient inside backward."""

    @staticmethod
    def forward(ctx: Any, x: ag.Tensor) -> ag.Tensor:
        return x * 3

    @staticmethod
    def backward(ctx: Any, grad: ag.Tensor) -> ag.Tensor:
        grad_input = grad * 3
        grad_input[0] = 0
        return grad_input


async def test_setitem_inside_a_backward() -> None:
    x = _randn(4)
    await ZeroFirst.apply(x).sum().backward()
    assert_close(x.grad, [0.0, 3.0, 3.0, 3.0])


async def test_setitem_inside_a_tensor_hook() -> None:
    x = _randn(3)

    def hook(grad: ag.Tensor) -> ag.Tensor:
        grad = grad.clone()
        grad[ag.tensor([1])] = 0.0
        return grad

    y = x * 2
    y.register_hook(hook)
    await y.sum().backward()
    assert_close(x.grad, [2.0, 0.0, 2.0])


# ------------------------------------------------------------------------- bounds checks


def test_gather_with_an_out_of_range_index_raises_like_torch(torch: Any) -> None:
    for bad in (-1, 3):
        for lib in (ag, torch):
            x = lib.ones(3, requires_grad=True)
            with pytest.raises(RuntimeError, match=f"index {bad} is out of bounds for dimension 0"):
                lib.gather(x, 0, lib.tensor([0, bad]))
    x = ag.ones(2, 3)
    with pytest.raises(RuntimeError, match="index 3 is out of bounds for dimension 1 with size 3"):
        x.gather(1, ag.tensor([[0], [3]]))


def test_index_select_with_an_out_of_range_index_raises_like_torch(torch: Any) -> None:
    for bad in (-1, 3):
        for lib in (ag, torch):
            with pytest.raises(IndexError, match="index out of range in self"):
                lib.index_select(lib.ones(3), 0, lib.tensor([bad]))


def test_getitem_with_an_out_of_range_integer_tensor_raises_like_torch(torch: Any) -> None:
    for lib in (ag, torch):
        x = lib.ones(2, 3)
        with pytest.raises(IndexError, match="index 3 is out of bounds for dimension"):
            x[:, lib.tensor([0, 3])]
        with pytest.raises(
            IndexError, match="index -3 is out of bounds for dimension 0 with size 2"
        ):
            x[lib.tensor([-3])]
        assert x[lib.tensor([-1])].shape == (1, 3)  # in range: wraps, as Python
    # PyTorch names the dimension inconsistently here; ours is the indexed dimension.
    with pytest.raises(IndexError, match="index 3 is out of bounds for dimension 1 with size 3"):
        ag.ones(2, 3)[:, ag.tensor([0, 3])]
    with pytest.raises(IndexError, match="index 2 is out of bounds for dimension 1 with size 2"):
        ag.ones(4, 2, 3)[..., ag.tensor([2]), :]
    with pytest.raises(IndexError, match="index 5 is out of bounds for dimension 0"):
        ag.zeros(3)[ag.tensor([5])] = 1.0


async def test_in_range_negative_indices_still_route_gradients(torch: Any) -> None:
    await check_against_torch(torch, lambda m, x: x[m.tensor([-1, 0, -1])] * x[1], _array(3, 2))
