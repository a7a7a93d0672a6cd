"""Shape ops: values against NumPy, gradients against finite differences and PyTorch, views."""

from __future__ import annotations

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


# ----------------------------------------------------------------------- reshape / view


@pytest.mark.parametrize(
    ("shape", "target"),
    [
        ((2, 3), (3, 2)),
        ((2, 3), (-1,)),
        ((4,), (2, -1)),
        ((), (1, 1)),
        ((1, 1), ()),
        ((0, 3), (3, -1)),
    ],
)
async def test_reshape_values_and_grad(
    shape: tuple[int, ...], target: tuple[int, ...], device: str
) -> None:
    x = _randn(*shape, device=device)
    y = x.reshape(target)
    assert_close(y, x.detach().cpu().data.reshape(target))
    assert y.grad_fn is not None
    assert y.grad_fn.name() == "ReshapeBackward0"
    if x.numel():
        assert await ag.gradcheck(lambda t: t.reshape(target), (x,))
        assert await ag.gradgradcheck(lambda t: t.reshape(target) * t.reshape(target), (x,))


async def test_reshape_matches_torch(torch: Any) -> None:
    await check_against_torch(torch, lambda lib, t: t.reshape(3, -1).view(2, 2, 3), _array(4, 3))


def test_reshape_rejects_bad_shapes() -> None:
    x = _randn(2, 3)
    with pytest.raises(RuntimeError, match="is invalid for input of size 6"):
        x.reshape(4, 2)
    with pytest.raises(RuntimeError, match="only one dimension can be inferred"):
        x.reshape(-1, -1)
    with pytest.raises(RuntimeError, match="is invalid for input of size 6"):
        x.reshape(-1, 4)


def test_view_shares_memory_and_version_counter() -> None:
    base = ag.zeros(2, 3, dtype="float64")
    v = base.view(6)
    assert np.shares_memory(v.data, base.data)
    base.add_(1.0)
    assert v._version == base._version == 1
    assert_close(v, np.ones(6))


def test_reshape_that_copies_has_its_own_version_counter() -> None:
    base = ag.zeros(2, 3, dtype="float64")
    copy = base.T.reshape(6)  # a transposed array cannot be flattened without a copy
    assert not np.shares_memory(copy.data, base.data)
    base.add_(1.0)
    assert copy._version == 0
    assert_close(copy, np.zeros(6))


async def test_inplace_on_base_after_saving_view_fails_backward() -> None:
    w = _randn(6)
    base = ag.randn(2, 3, dtype="float64")
    v = base.view(6)
    loss = (w * v).sum()  # saves the view v for w's gradient
    base.add_(1.0)  # modifies v's memory: the saved view is now stale
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        await loss.backward()


async def test_inplace_on_base_through_basic_index_view_fails_backward() -> None:
    w = _randn(3)
    base = ag.randn(2, 3, dtype="float64")
    row = base[1]
    loss = (w * row).sum()
    base.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        await loss.backward()


async def test_deep_chain_of_views_has_no_recursion_limit() -> None:
    x = _randn(2, 3)
    y = x
    for i in range(10_000):
        y = y.unsqueeze(0) if i % 2 == 0 else y.reshape(2, 3)
    depth = 0
    node = y.grad_fn
    while node is not None and node.next_functions:
        node = node.next_functions[0][0]
        depth += 1
    assert depth >= 10_000
    await (y * 2.0).sum().backward()
    assert x.grad is not None
    assert_close(x.grad, np.full((2, 3), 2.0))


# ----------------------------------------------------------------------------- expand


@pytest.mark.parametrize(
    ("shape", "target"),
    [((3, 1), (3, 4)), ((3,), (2, 3)), ((1, 1), (2, -1, 3)), ((), (2, 2)), ((2, 1), (-1, 2))],
)
async def test_expand_values_and_grad(
    shape: tuple[int, ...], target: tuple[int, ...], device: str
) -> None:
    x = _randn(*shape, device=device)
    y = x.expand(*target)
    expected_shape = tuple(
        x.shape[i - (len(target) - x.ndim)] if s == -1 else s for i, s in enumerate(target)
    )
    assert_close(y, np.broadcast_to(x.detach().cpu().data, expected_shape))
    assert await ag.gradcheck(lambda t: t.expand(*target), (x,))
    assert await ag.gradgradcheck(lambda t: t.expand(*target) * t.expand(*target), (x,))


async def test_expand_matches_torch(torch: Any) -> None:
    await check_against_torch(torch, lambda lib, t: t.expand(2, 3, 4) * 1.5, _array(3, 1))
    await check_against_torch(
        torch, lambda lib, t, u: t.expand_as(u) * u, _array(1, 4), _array(3, 4)
    )


def test_expand_errors() -> None:
    x = _randn(2, 3)
    with pytest.raises(RuntimeError, match="must match the existing size"):
        x.expand(2, 4)
    with pytest.raises(RuntimeError, match="leading, non-existing dimension"):
        x.expand(-1, 2, 3)
    with pytest.raises(RuntimeError, match="must be greater or equal"):
        x.expand(3)


# ------------------------------------------------------------ permute / transpose / T / mT


@pytest.mark.parametrize("dims", [(2, 0, 1), (-1, -3, -2), (0, 2, 1), (1, 0, 2)])
async def test_permute_values_and_grad(dims: tuple[int, ...], device: str) -> None:
    x = _randn(2, 3, 4, device=device)
    y = x.permute(*dims)
    assert_close(y, np.transpose(x.detach().cpu().data, dims))
    assert np.shares_memory(y.data, x.data)
    assert await ag.gradcheck(lambda t: t.permute(dims), (x,))


async def test_permute_second_derivative() -> None:
    x = _randn(2, 3)
    assert await ag.gradgradcheck(lambda t: t.permute(1, 0) * t.T, (x,))


def test_permute_rejects_non_permutations() -> None:
    x = _randn(2, 3)
    with pytest.raises(RuntimeError, match="not a permutation"):
        x.permute(0, 0)
    with pytest.raises(RuntimeError, match="not a permutation"):
        x.permute(0)
    with pytest.raises(IndexError, match="Dimension out of range"):
        x.permute(0, 2)


@pytest.mark.parametrize(("dim0", "dim1"), [(0, 1), (-1, 0), (-1, -3), (1, 1)])
async def test_transpose_values_and_grad(dim0: int, dim1: int) -> None:
    x = _randn(2, 3, 4)
    y = x.transpose(dim0, dim1)
    assert_close(y, np.swapaxes(x.detach().data, dim0, dim1))
    assert await ag.gradcheck(lambda t: t.transpose(dim0, dim1), (x,))


@pytest.mark.parametrize("shape", [(), (3,)])
def test_transpose_of_low_rank_tensors_is_identity(shape: tuple[int, ...]) -> None:
    x = _randn(*shape)
    assert x.transpose(0, -1) is x
    assert x.T is x
    with pytest.raises(IndexError, match="Dimension out of range"):
        x.transpose(0, 1)


async def test_transposes_match_torch(torch: Any) -> None:
    await check_against_torch(
        torch, lambda lib, t: (t.transpose(0, -1), t.mT, t.permute(1, 2, 0)), _array(2, 3, 4)
    )
    await check_against_torch(torch, lambda lib, t: t.T * 2.0, _array(2, 3))


# ----------------------------------------------------------------- squeeze / unsqueeze


@pytest.mark.parametrize(
    ("shape", "dim", "expected"),
    [
        ((1, 3, 1), None, (3,)),
        ((1, 3, 1), 0, (3, 1)),
        ((1, 3, 1), -1, (1, 3)),
        ((1, 3, 1), 1, (1, 3, 1)),
        ((1, 3, 1), (0, 2), (3,)),
        ((1, 3, 1), (-1, 1), (1, 3)),
        ((), None, ()),
        ((), 0, ()),
        ((1,), -1, ()),
    ],
)
async def test_squeeze(
    shape: tuple[int, ...], dim: Any, expected: tuple[int, ...], device: str
) -> None:
    x = _randn(*shape, device=device)
    y = ag.squeeze(x, dim)
    assert y.shape == expected
    assert_close(y, x.detach().cpu().data.reshape(expected))
    assert await ag.gradcheck(lambda t: ag.squeeze(t, dim), (x,))


@pytest.mark.parametrize(
    ("shape", "dim", "expected"),
    [
        ((2, 3), 0, (1, 2, 3)),
        ((2, 3), -1, (2, 3, 1)),
        ((2, 3), 1, (2, 1, 3)),
        ((2, 3), -3, (1, 2, 3)),
        ((), 0, (1,)),
        ((), -1, (1,)),
    ],
)
async def test_unsqueeze(shape: tuple[int, ...], dim: int, expected: tuple[int, ...]) -> None:
    x = _randn(*shape)
    y = x.unsqueeze(dim)
    assert y.shape == expected
    assert_close(y, np.expand_dims(x.detach().data, dim))
    assert await ag.gradcheck(lambda t: t.unsqueeze(dim), (x,))
    assert await ag.gradgradcheck(lambda t: t.unsqueeze(dim) * t.unsqueeze(dim), (x,))


def test_unsqueeze_out_of_range() -> None:
    with pytest.raises(IndexError, match="Dimension out of range"):
        _randn(2, 3).unsqueeze(3)


async def test_squeeze_unsqueeze_match_torch(torch: Any) -> None:
    await check_against_torch(
        torch,
        lambda lib, t: (t.squeeze(), t.squeeze(0), t.squeeze(-1), t.unsqueeze(-2)),
        _array(1, 3, 1),
    )


# ----------------------------------------------------------------------------- flatten


@pytest.mark.parametrize(
    ("shape", "start", "end", "expected"),
    [
        ((2, 3, 4), 0, -1, (24,)),
        ((2, 3, 4), 1, -1, (2, 12)),
        ((2, 3, 4), 0, 1, (6, 4)),
        ((2, 3, 4), -2, -2, (2, 3, 4)),
        ((2, 3, 4), -3, -2, (6, 4)),
        ((), 0, -1, (1,)),
        ((5,), 0, 0, (5,)),
    ],
)
async def test_flatten(
    shape: tuple[int, ...], start: int, end: int, expected: tuple[int, ...], device: str
) -> None:
    x = _randn(*shape, device=device)
    y = x.flatten(start, end)
    assert y.shape == expected
    assert_close(y, x.detach().cpu().data.reshape(expected))
    assert await ag.gradcheck(lambda t: ag.flatten(t, start, end), (x,))


async def test_flatten_matches_torch(torch: Any) -> None:
    await check_against_torch(
        torch, lambda lib, t: (lib.flatten(t), t.flatten(1), t.flatten(-3, -2)), _array(2, 3, 2)
    )
    await check_against_torch(torch, lambda lib, t: lib.flatten(t) * 3.0, np.array(1.5))


def test_flatten_rejects_reversed_dims() -> None:
    with pytest.raises(RuntimeError, match="start_dim cannot come after end_dim"):
        ag.flatten(_randn(2, 3, 4), 2, 1)


# --------------------------------------------------------------------------------- cat


@pytest.mark.parametrize(
    ("shapes", "dim"),
    [
        ([(2, 3), (1, 3), (4, 3)], 0),
        ([(2, 3), (2, 1)], 1),
        ([(2, 3), (2, 2)], -1),
        ([(2, 1, 2), (2, 3, 2)], -2),
        ([(3,)], 0),
        ([(0, 2), (2, 2)], 0),
    ],
)
async def test_cat_values_and_grad(shapes: list[tuple[int, ...]], dim: int, device: str) -> None:
    xs = [_randn(*s, device=device) for s in shapes]
    y = ag.cat(xs, dim)
    assert_close(y, np.concatenate([x.detach().cpu().data for x in xs], axis=dim))
    assert y.grad_fn is not None
    assert y.grad_fn.name() == "CatBackward0"
    assert await ag.gradcheck(lambda *ts: ag.cat(ts, dim), xs)


async def test_cat_second_derivative() -> None:
    a, b = _randn(2), _randn(2)
    assert await ag.gradgradcheck(lambda s, t: ag.cat([s * t, t, s], 0) ** 2, (a, b))


async def test_cat_where_only_some_inputs_require_grad() -> None:
    a = _randn(2, 3)
    b = _randn(1, 3, requires_grad=False)
    c = _randn(3, 3)
    weight = np.arange(18.0).reshape(6, 3)
    await (ag.cat([a, b, c]) * weight).sum().backward()
    assert a.grad is not None
    assert c.grad is not None
    assert b.grad is None
    assert_close(a.grad, weight[:2])
    assert_close(c.grad, weight[3:])


async def test_cat_matches_torch(torch: Any) -> None:
    await check_against_torch(
        torch, lambda lib, a, b: lib.cat([a, b, a], dim=-1), _array(2, 3), _array(2, 1, seed=1)
    )
    await check_against_torch(
        torch,
        lambda lib, a, b: lib.cat((a, b)),
        _array(2, 3),
        _array(1, 3, seed=1),
        requires_grad=(False, True),
    )


def test_cat_errors() -> None:
    with pytest.raises(ValueError, match="non-empty list"):
        ag.cat([])
    with pytest.raises(RuntimeError, match="Sizes of tensors must match except in dimension 0"):
        ag.cat([_randn(2, 3), _randn(2, 4)])
    with pytest.raises(RuntimeError, match="zero-dimensional tensor"):
        ag.cat([_randn(), _randn()])
    with pytest.raises(RuntimeError, match="same number of dimensions"):
        ag.cat([_randn(2, 3), _randn(3)])
    with pytest.raises(IndexError, match="Dimension out of range"):
        ag.cat([_randn(2, 3)], 2)


# ------------------------------------------------------------------------------- stack


@pytest.mark.parametrize(
    ("shape", "dim"), [((2, 3), 0), ((2, 3), 2), ((2, 3), -1), ((2, 3), -2), ((), 0)]
)
async def test_stack_values_and_grad(shape: tuple[int, ...], dim: int, device: str) -> None:
    xs = [_randn(*shape, device=device) for _ in range(3)]
    y = ag.stack(xs, dim)
    assert_close(y, np.stack([x.detach().cpu().data for x in xs], axis=dim))
    assert y.grad_fn is not None
    assert y.grad_fn.name() == "StackBackward0"
    assert await ag.gradcheck(lambda *ts: ag.stack(ts, dim), xs)


async def test_stack_second_derivative() -> None:
    a, b = _randn(2), _randn(2)
    assert await ag.gradgradcheck(lambda s, t: ag.stack([s * t, s], -1) ** 2, (a, b))


async def test_stack_where_only_some_inputs_require_grad() -> None:
    a = _randn(3, requires_grad=False)
    b = _randn(3)
    weight = np.arange(6.0).reshape(3, 2)
    await (ag.stack([a, b], dim=1) * weight).sum().backward()
    assert a.grad is None
    assert b.grad is not None
    assert_close(b.grad, weight[:, 1])


async def test_stack_matches_torch(torch: Any) -> None:
    await check_against_torch(
        torch, lambda lib, a, b: lib.stack([a, b, a], dim=1), _array(2, 3), _array(2, 3, seed=1)
    )


def test_stack_errors() -> None:
    with pytest.raises(ValueError, match="non-empty list"):
        ag.stack([])
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        ag.stack([_randn(2, 3), _randn(2, 4)])
    with pytest.raises(IndexError, match="Dimension out of range"):
        ag.stack([_randn(2, 3)], 3)


# ------------------------------------------------------------------------ split / chunk


@pytest.mark.parametrize(
    ("size", "dim", "expected"),
    [
        (2, 0, [2, 2, 1]),
        (5, 0, [5]),
        (7, 0, [5]),
        ([1, 4], 0, [1, 4]),
        ([2, 0, 3], 0, [2, 0, 3]),
        (1, -1, [1, 1]),
        ([1, 1], 1, [1, 1]),
    ],
)
async def test_split_values_and_grad(
    size: int | list[int], dim: int, expected: list[int], device: str
) -> None:
    x = _randn(5, 2, device=device)
    pieces = x.split(size, dim)
    assert [p.shape[dim] for p in pieces] == expected
    boundaries = np.cumsum(expected)[:-1]
    for piece, ref in zip(
        pieces, np.split(x.detach().cpu().data, boundaries, axis=dim), strict=True
    ):
        assert_close(piece, ref)
        assert piece._version_counter is x._version_counter  # views of x
    name = "SplitWithSizesBackward0" if isinstance(size, list) else "SplitBackward0"
    assert pieces[0].grad_fn is not None
    assert pieces[0].grad_fn.name() == name
    assert await ag.gradcheck(lambda t: ag.split(t, size, dim), (x,))


async def test_split_second_derivative() -> None:
    x = _randn(5)
    assert await ag.gradgradcheck(lambda t: tuple(p * p for p in t.split([2, 3])), (x,))
    assert await ag.gradgradcheck(lambda t: t.split(2)[1] ** 3, (x,))


async def test_split_unused_pieces_get_zero_gradient() -> None:
    x = _randn(7, 2)
    _, middle, _ = x.split([2, 3, 2])
    weight = np.arange(6.0).reshape(3, 2)
    await (middle * weight).sum().backward()
    expected = np.zeros((7, 2))
    expected[2:5] = weight
    assert x.grad is not None
    assert_close(x.grad, expected)


async def test_split_matches_torch(torch: Any) -> None:
    await check_against_torch(torch, lambda lib, t: t.split(2, dim=-1), _array(3, 5))
    await check_against_torch(torch, lambda lib, t: t.split([1, 2])[1], _array(3, 2))
    await check_against_torch(torch, lambda lib, t: lib.split(t, 2)[-1], _array(5, 2))


def test_split_errors() -> None:
    x = _randn(5)
    with pytest.raises(RuntimeError, match="split_with_sizes expects split_sizes to sum exactly"):
        x.split([2, 2])
    with pytest.raises(RuntimeError, match="split_size can only be 0"):
        x.split(0)
    with pytest.raises(RuntimeError, match="non-negative"):
        x.split(-1)


@pytest.mark.parametrize(
    ("length", "chunks", "expected"),
    [
        (6, 3, [2, 2, 2]),
        (5, 2, [3, 2]),
        (5, 4, [2, 2, 1]),
        (6, 4, [2, 2, 2]),
        (2, 5, [1, 1]),
        (0, 3, [0, 0, 0]),
    ],
)
async def test_chunk_sizes_and_grad(length: int, chunks: int, expected: list[int]) -> None:
    x = _randn(2, length)
    pieces = x.chunk(chunks, -1)
    assert [p.shape for p in pieces] == [(2, n) for n in expected]
    assert_close(ag.cat(pieces, 1), x.detach().data)
    if length:
        assert await ag.gradcheck(lambda t: ag.chunk(t, chunks, 1), (x,))


async def test_chunk_unused_pieces_get_zero_gradient(torch: Any) -> None:
    await check_against_torch(torch, lambda lib, t: t.chunk(3)[0] * t.chunk(3)[2], _array(5, 2))
    x = _randn(5)
    await (x.chunk(3)[1] * 2.0).sum().backward()
    assert x.grad is not None
    assert_close(x.grad, [0.0, 0.0, 2.0, 2.0, 0.0])


async def test_chunk_matches_torch(torch: Any) -> None:
    await check_against_torch(torch, lambda lib, t: lib.chunk(t, 4, dim=1), _array(2, 5))


def test_chunk_rejects_non_positive_chunks() -> None:
    with pytest.raises(RuntimeError, match="greater than 0"):
        _randn(4).chunk(0)
