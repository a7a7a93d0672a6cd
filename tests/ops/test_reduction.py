"""Tests for ``aioautograd.ops.reduction``: values against NumPy, gradients against finite
differences (first and second order) and everything against ``torch.autograd``."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest

import aioautograd as ag
from aioautograd.ops.reduction import argmax, argmin, sum_to_size
from tests.helpers import assert_close, to_numpy

Dim = int | tuple[int, ...] | None


def _axis(data: np.ndarray, dim: Dim) -> Any:
    return None if data.ndim == 0 else dim


def _np_max_dim(data: np.ndarray, dim: Dim, keepdim: bool) -> np.ndarray:
    return data if data.ndim == 0 else np.max(data, axis=dim, keepdims=keepdim)


def _np_min_dim(data: np.ndarray, dim: Dim, keepdim: bool) -> np.ndarray:
    return data if data.ndim == 0 else np.min(data, axis=dim, keepdims=keepdim)


def _np_softmax(data: np.ndarray, dim: Dim) -> np.ndarray:
    e = np.exp(data)
    return e / np.sum(e, axis=_axis(data, dim), keepdims=True)


class Case(NamedTuple):
    fn: Callable[[ag.Tensor, Dim, bool], ag.Tensor]
    reference: Callable[[np.ndarray, Dim, bool], np.ndarray]
    torch_fn: Callable[[Any, Any, Dim, bool], Any]  # (torch, tensor, dim, keepdim)
    node: Callable[[Dim], str | None]  # expected node name (None: not checked)
    dims: str  # which dims it takes: "multi" (int, tuple, None), "single" (int), "none"
    has_keepdim: bool = True


def _torch_reduce(method: str) -> Callable[[Any, Any, Dim, bool], Any]:
    def call(torch: Any, t: Any, dim: Dim, keepdim: bool) -> Any:
        if dim is None:
            return getattr(t, method)()
        return getattr(t, method)(dim, keepdim=keepdim)

    return call


CASES: dict[str, Case] = {
    "sum": Case(
        lambda x, d, k: ag.sum(x, d, k),
        lambda a, d, k: np.sum(a, axis=_axis(a, d), keepdims=k),
        _torch_reduce("sum"),
        lambda d: "SumBackward0" if d is None else "SumBackward1",
        "multi",
    ),
    "mean": Case(
        lambda x, d, k: ag.mean(x, d, k),
        lambda a, d, k: np.mean(a, axis=_axis(a, d), keepdims=k),
        _torch_reduce("mean"),
        lambda d: "MeanBackward0" if d is None else "MeanBackward1",
        "multi",
    ),
    "var": Case(
        lambda x, d, k: ag.var(x, d, keepdim=k),
        lambda a, d, k: np.var(a, axis=_axis(a, d), keepdims=k, ddof=1),
        _torch_reduce("var"),
        lambda d: "VarBackward0",
        "multi",
    ),
    "logsumexp": Case(
        lambda x, d, k: ag.logsumexp(x, d, k),
        lambda a, d, k: np.log(np.sum(np.exp(a), axis=_axis(a, d), keepdims=k)),
        lambda torch, t, d, k: t.logsumexp(d, keepdim=k),
        lambda d: "LogsumexpBackward0",
        "multi",
    ),
    "max": Case(
        lambda x, d, k: ag.max(x),
        lambda a, d, k: np.max(a),
        lambda torch, t, d, k: t.max(),
        lambda d: "MaxBackward1",
        "none",
        has_keepdim=False,
    ),
    "min": Case(
        lambda x, d, k: ag.min(x),
        lambda a, d, k: np.min(a),
        lambda torch, t, d, k: t.min(),
        lambda d: "MinBackward1",
        "none",
        has_keepdim=False,
    ),
    "max_dim": Case(
        lambda x, d, k: ag.max(x, d, k).values,
        _np_max_dim,
        lambda torch, t, d, k: t.max(d, keepdim=k).values,
        lambda d: "MaxBackward0",
        "single",
    ),
    "min_dim": Case(
        lambda x, d, k: ag.min(x, d, k).values,
        _np_min_dim,
        lambda torch, t, d, k: t.min(d, keepdim=k).values,
        lambda d: "MinBackward0",
        "single",
    ),
    "softmax": Case(
        lambda x, d, k: ag.softmax(x, d),  # type: ignore[arg-type]
        lambda a, d, k: _np_softmax(a, d),
        lambda torch, t, d, k: t.softmax(d),
        lambda d: "SoftmaxBackward0",
        "single",
        has_keepdim=False,
    ),
    "log_softmax": Case(
        lambda x, d, k: ag.log_softmax(x, d),  # type: ignore[arg-type]
        lambda a, d, k: np.log(_np_softmax(a, d)),
        lambda torch, t, d, k: t.log_softmax(d),
        lambda d: "LogSoftmaxBackward0",
        "single",
        has_keepdim=False,
    ),
}

SHAPE_DIMS: list[tuple[tuple[int, ...], Dim]] = [
    ((), None),
    ((), 0),
    ((), -1),
    ((4,), None),
    ((4,), 0),
    ((4,), -1),
    ((2, 3), None),
    ((2, 3), 0),
    ((2, 3), 1),
    ((2, 3), -2),
    ((2, 3), (0, 1)),
    ((2, 1, 3), (0, -1)),
    ((2, 1, 3), 1),
]


def _count(shape: tuple[int, ...], dim: Dim) -> int:
    if not shape:
        return 1
    dims = range(len(shape)) if dim is None else (dim,) if isinstance(dim, int) else dim
    return int(np.prod([shape[d] for d in dims]))


def _accepts(name: str, shape: tuple[int, ...], dim: Dim) -> bool:
    kind = CASES[name].dims
    if kind == "none":
        return dim is None
    if kind == "single" and not isinstance(dim, int):
        return False
    if name == "logsumexp" and dim is None:
        return False  # PyTorch requires a dim
    return not (name == "var" and _count(shape, dim) < 2)  # var needs 2 samples


PARAMS = [
    pytest.param(name, shape, dim, keepdim, id=f"{name}-{shape}-{dim}-{keepdim}")
    for name in CASES
    for shape, dim in SHAPE_DIMS
    if _accepts(name, shape, dim)
    for keepdim in ((False, True) if CASES[name].has_keepdim and dim is not None else (False,))
]


def _data(shape: tuple[int, ...]) -> np.ndarray:
    # Distinct values: no ties for max/min in finite differences.
    data = np.random.default_rng(len(shape)).permutation(max(int(np.prod(shape)), 1))
    return (0.5 * data + 0.1 * np.random.default_rng(1).standard_normal(data.shape)).reshape(shape)


def _leaf(data: np.ndarray, device: str) -> ag.Tensor:
    return ag.tensor(data, dtype="float64", device=device, requires_grad=True)


@pytest.mark.parametrize(("name", "shape", "dim", "keepdim"), PARAMS)
def test_values_match_numpy(
    name: str, shape: tuple[int, ...], dim: Dim, keepdim: bool, device: str
) -> None:
    data = _data(shape)
    out = CASES[name].fn(ag.tensor(data, device=device), dim, keepdim)
    expected = np.asarray(CASES[name].reference(data, dim, keepdim))
    assert out.shape == expected.shape
    assert out.dtype == np.float64
    assert_close(out, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(("name", "shape", "dim", "keepdim"), PARAMS)
async def test_gradcheck(
    name: str, shape: tuple[int, ...], dim: Dim, keepdim: bool, device: str
) -> None:
    x = _leaf(_data(shape), device)
    assert await ag.gradcheck(lambda t: CASES[name].fn(t, dim, keepdim), (x,))


@pytest.mark.parametrize(("name", "shape", "dim", "keepdim"), PARAMS)
async def test_gradgradcheck(
    name: str, shape: tuple[int, ...], dim: Dim, keepdim: bool, device: str
) -> None:
    x = _leaf(_data(shape), device)
    assert await ag.gradgradcheck(lambda t: CASES[name].fn(t, dim, keepdim), (x,))


@pytest.mark.parametrize(("name", "shape", "dim", "keepdim"), PARAMS)
async def test_matches_torch(
    name: str, shape: tuple[int, ...], dim: Dim, keepdim: bool, device: str, torch: Any
) -> None:
    data = _data(shape)
    x, t = _leaf(data, device), torch.tensor(data, requires_grad=True)
    out, expected = CASES[name].fn(x, dim, keepdim), CASES[name].torch_fn(torch, t, dim, keepdim)
    assert out.shape == tuple(expected.shape)
    assert_close(out, expected, rtol=1e-12, atol=1e-14)
    node = CASES[name].node(dim)
    if node is not None:
        assert out.grad_fn is not None
        assert out.grad_fn.name() == node == expected.grad_fn.name()
    seed = np.random.default_rng(7).standard_normal(tuple(expected.shape))
    await out.backward(ag.tensor(seed, device=device))
    expected.backward(torch.tensor(seed))
    assert_close(x.grad, t.grad, rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------------- max / min


@pytest.mark.parametrize(
    ("fn", "torch_fn"),
    [(ag.max, lambda t: t.max()), (ag.min, lambda t: t.min())],
    ids=["max", "min"],
)
@pytest.mark.parametrize(
    "values",
    [[3.0, 1.0, 3.0, 3.0], [[1.0, 1.0], [1.0, 1.0]], [2.0, float("nan"), 5.0, float("nan")]],
    ids=["three-way-tie", "all-equal", "nan"],
)
async def test_full_reduction_splits_gradient_among_ties(
    fn: Any, torch_fn: Any, values: list[Any], device: str, torch: Any
) -> None:
    data = np.array(values)
    x, t = _leaf(data, device), torch.tensor(data, requires_grad=True)
    out, expected = fn(x), torch_fn(t)
    np.testing.assert_array_equal(to_numpy(out), to_numpy(expected))
    await (3 * out).backward()
    (3 * expected).backward()
    assert_close(x.grad, t.grad, rtol=1e-15, atol=0)
    assert float(to_numpy(x.grad).sum()) == pytest.approx(3.0)


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize(("dim", "keepdim"), [(0, False), (1, True), (-1, False)])
async def test_dim_reduction_with_ties_matches_torch(
    largest: bool, dim: int, keepdim: bool, device: str, torch: Any
) -> None:
    data = np.array([[3.0, 1.0, 3.0, 3.0], [1.0, 2.0, 2.0, 1.0], [3.0, 2.0, 0.0, 1.0]])
    x, t = _leaf(data, device), torch.tensor(data, requires_grad=True)
    result = (ag.max if largest else ag.min)(x, dim, keepdim)
    expected = (t.max if largest else t.min)(dim, keepdim=keepdim)
    np.testing.assert_array_equal(to_numpy(result.values), to_numpy(expected.values))
    np.testing.assert_array_equal(to_numpy(result.indices), to_numpy(expected.indices))
    arg = np.argmax if largest else np.argmin
    np.testing.assert_array_equal(
        to_numpy(result.indices), arg(data, axis=dim, keepdims=keepdim)
    )  # the first of tied extremes
    await (2 * result.values).sum().backward()
    (2 * expected.values).sum().backward()
    np.testing.assert_array_equal(to_numpy(x.grad), to_numpy(t.grad))


@pytest.mark.parametrize("keepdim", [False, True])
async def test_max_dim_returns_named_tuple(keepdim: bool, device: str) -> None:
    x = _leaf(np.array([[0.0, 5.0, 1.0], [7.0, 2.0, 3.0]]), device)
    result = ag.max(x, 1, keepdim)
    values, indices = result
    assert values is result.values
    assert indices is result.indices
    assert type(result).__name__ == "MaxResult"
    assert indices.dtype == np.int64
    assert not indices.requires_grad
    assert indices.grad_fn is None
    assert values.requires_grad
    expected_shape = (2, 1) if keepdim else (2,)
    assert values.shape == indices.shape == expected_shape
    np.testing.assert_array_equal(to_numpy(indices).ravel(), [1, 0])
    await values.sum().backward()
    np.testing.assert_array_equal(to_numpy(x.grad), [[0, 1, 0], [1, 0, 0]])


async def test_min_dim_values_and_indices_on_zero_dim_tensor(device: str, torch: Any) -> None:
    x = _leaf(np.array(2.5), device)
    values, indices = ag.min(x, 0)
    expected = torch.tensor(2.5).min(0)
    assert values.shape == indices.shape == ()
    assert float(values) == float(expected.values)
    assert int(indices) == int(expected.indices) == 0
    await values.backward()
    assert float(to_numpy(x.grad)) == 1.0


async def test_max_dim_values_only_backward_through_one_of_two_uses(device: str) -> None:
    x = _leaf(np.array([[1.0, 4.0], [3.0, 2.0]]), device)
    values, _ = ag.max(x, 0)
    y = (values * values).sum() + x.sum()
    await y.backward()
    np.testing.assert_array_equal(to_numpy(x.grad), [[1.0, 9.0], [7.0, 1.0]])


def test_max_with_tensor_is_maximum() -> None:
    a = ag.tensor([1.0, 5.0])
    b = ag.tensor([3.0, 2.0])
    np.testing.assert_array_equal(to_numpy(ag.max(a, b)), [3.0, 5.0])
    np.testing.assert_array_equal(to_numpy(ag.min(a, b)), [1.0, 2.0])


def test_max_errors() -> None:
    with pytest.raises(RuntimeError, match="Expected reduction dim to be specified"):
        ag.max(ag.zeros(0))
    with pytest.raises(TypeError, match="keepdim"):
        ag.min(ag.zeros(2), keepdim=True)
    with pytest.raises(IndexError, match="Dimension out of range"):
        ag.max(ag.zeros(2, 3), 2)
    with pytest.raises(IndexError, match="non-zero size"):
        ag.min(ag.zeros(2, 0), 1)


def test_tensor_methods_route_to_the_reductions() -> None:
    data = np.array([[0.5, -1.0, 2.0], [1.5, 0.0, -2.0]])
    x = ag.tensor(data)
    assert float(x.max()) == 2.0
    assert float(x.min()) == -2.0
    np.testing.assert_array_equal(to_numpy(x.max(1).indices), [2, 0])
    np.testing.assert_array_equal(to_numpy(x.min(dim=0).values), [0.5, -1.0, -2.0])
    assert_close(x.var(1), np.var(data, axis=1, ddof=1))
    assert_close(x.var(unbiased=False), np.var(data))
    assert_close(x.logsumexp(0), np.log(np.exp(data).sum(0)))
    assert_close(x.softmax(-1), _np_softmax(data, -1))
    assert_close(x.log_softmax(0), np.log(_np_softmax(data, 0)))
    np.testing.assert_array_equal(to_numpy(x.argmax(1)), [2, 0])
    np.testing.assert_array_equal(to_numpy(x.argmin()), 5)


# ----------------------------------------------------------------------- var


@pytest.mark.parametrize(
    ("kwargs", "ddof"),
    [
        ({}, 1),
        ({"unbiased": True}, 1),
        ({"unbiased": False}, 0),
        ({"correction": 0}, 0),
        ({"correction": 2}, 2),
    ],
)
@pytest.mark.parametrize(("dim", "keepdim"), [(None, False), (1, True), ((0, 2), False)])
async def test_var_corrections_match_numpy_and_torch(
    kwargs: dict[str, Any], ddof: int, dim: Dim, keepdim: bool, device: str, torch: Any
) -> None:
    data = np.random.default_rng(3).standard_normal((3, 4, 2))
    x, t = _leaf(data, device), torch.tensor(data, requires_grad=True)
    out = ag.var(x, dim, keepdim=keepdim, **kwargs)
    assert_close(out, np.var(data, axis=dim, ddof=ddof, keepdims=keepdim), rtol=1e-12)
    expected = t.var(dim, keepdim=keepdim, **kwargs)
    assert_close(out, expected, rtol=1e-12)
    seed = np.random.default_rng(0).standard_normal(tuple(expected.shape))
    await out.backward(ag.tensor(seed, device=device))
    expected.backward(torch.tensor(seed))
    assert_close(x.grad, t.grad, rtol=1e-12)


def test_var_without_degrees_of_freedom_warns_and_matches_torch(torch: Any) -> None:
    with pytest.warns(UserWarning, match="degrees of freedom is <= 0"):
        out = ag.var(ag.tensor([2.0], dtype="float64"))
    with pytest.warns(UserWarning, match="degrees of freedom is <= 0"):
        biased = ag.var(ag.tensor([1.0, 3.0], dtype="float64"), correction=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = torch.tensor([2.0], dtype=torch.float64).var()
        expected_biased = torch.tensor([1.0, 3.0], dtype=torch.float64).var(correction=2)
    np.testing.assert_array_equal(to_numpy(out), to_numpy(expected))  # nan
    np.testing.assert_array_equal(to_numpy(biased), to_numpy(expected_biased))  # inf


def test_var_errors() -> None:
    with pytest.raises(RuntimeError, match="cannot specify both"):
        ag.var(ag.zeros(3), unbiased=True, correction=1)
    with pytest.raises(RuntimeError, match="floating point"):
        ag.var(ag.arange(3))


# ---------------------------------------------------------- logsumexp and softmax


async def test_logsumexp_is_stable_and_matches_torch(torch: Any) -> None:
    inf = float("inf")
    data = np.array([[1000.0, 1000.0, -inf], [-1000.0, -1001.0, -1002.0], [0.0, 1.0, 2.0]])
    x, t = _leaf(data, "cpu"), torch.tensor(data, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = ag.logsumexp(x, 1)
        await out.sum().backward()
    assert_close(out[0], 1000.0 + np.log(2.0), rtol=1e-15)
    expected = t.logsumexp(1)
    expected.sum().backward()
    assert_close(out, expected, rtol=1e-15)
    assert_close(x.grad, t.grad, rtol=1e-14)


@pytest.mark.parametrize("keepdim", [False, True])
def test_logsumexp_of_all_minus_inf_is_minus_inf(keepdim: bool, torch: Any) -> None:
    data = np.array([[-np.inf, -np.inf], [0.0, -np.inf]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = ag.logsumexp(ag.tensor(data), -1, keepdim)
    expected = torch.tensor(data).logsumexp(-1, keepdim=keepdim)
    np.testing.assert_array_equal(to_numpy(out), to_numpy(expected))
    assert to_numpy(out).ravel()[0] == -np.inf


@pytest.mark.parametrize(
    ("fn", "torch_fn"),
    [(ag.softmax, lambda t: t.softmax(1)), (ag.log_softmax, lambda t: t.log_softmax(1))],
    ids=["softmax", "log_softmax"],
)
async def test_softmax_is_stable_and_matches_torch(fn: Any, torch_fn: Any, torch: Any) -> None:
    data = np.array([[1000.0, 0.0, -1000.0], [-1000.0, -1001.0, -1002.0], [5.0, 5.0, 5.0]])
    x, t = _leaf(data, "cpu"), torch.tensor(data, requires_grad=True)
    seed = np.random.default_rng(0).standard_normal(data.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = fn(x, 1)
        await out.backward(ag.tensor(seed))
    expected = torch_fn(t)
    expected.backward(torch.tensor(seed))
    assert np.isfinite(to_numpy(out)).all()
    assert_close(out, expected, rtol=1e-14, atol=1e-300)
    assert_close(x.grad, t.grad, rtol=1e-12, atol=1e-300)


def test_softmax_rows_sum_to_one(device: str) -> None:
    x = ag.randn(3, 5, dtype="float64", device=device) * 10
    for dim in (0, 1, -1):
        assert_close(ag.softmax(x, dim).sum(dim), np.ones(x.shape[1 - dim % 2]), rtol=1e-15)
        assert_close(ag.log_softmax(x, dim).exp(), ag.softmax(x, dim), rtol=1e-14)


# ------------------------------------------------------------------ argmax / argmin


@pytest.mark.parametrize(
    ("shape", "dim", "keepdim"),
    [((), None, False), ((), 0, False), ((5,), None, False), ((5,), 0, True),
     ((2, 3), None, True), ((2, 3), 1, False), ((2, 3), -2, True), ((2, 1, 3), 2, False)],
)  # fmt: skip
@pytest.mark.parametrize("largest", [True, False])
def test_argmax_argmin_match_torch(
    shape: tuple[int, ...], dim: int | None, keepdim: bool, largest: bool, device: str, torch: Any
) -> None:
    data = np.round(np.random.default_rng(2).standard_normal(shape))  # with ties
    x = ag.tensor(data, device=device, requires_grad=True)
    out = (argmax if largest else argmin)(x, dim, keepdim)
    expected = (torch.argmax if largest else torch.argmin)(torch.tensor(data), dim, keepdim)
    assert out.dtype == np.int64
    assert not out.requires_grad
    assert out.grad_fn is None
    assert out.shape == tuple(expected.shape)
    np.testing.assert_array_equal(to_numpy(out), expected.numpy())


def test_argmax_takes_the_first_tie() -> None:
    x = ag.tensor([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0]])
    np.testing.assert_array_equal(to_numpy(argmax(x, 1)), [1, 0])
    np.testing.assert_array_equal(to_numpy(argmin(x, 0)), [0, 1, 1])
    assert int(argmax(x)) == 1


# -------------------------------------------------------------- sum_to_size


@pytest.mark.parametrize(
    ("shape", "target"), [((2, 3), (3,)), ((2, 3), (2, 1)), ((4, 2, 3), (1, 3)), ((2, 3), ())]
)
async def test_sum_to_size(shape: tuple[int, ...], target: tuple[int, ...], device: str) -> None:
    data = np.random.default_rng(4).standard_normal(shape)
    x = _leaf(data, device)
    out = sum_to_size(x, target)
    assert out.shape == target
    lead = len(shape) - len(target)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, s in enumerate(target) if s == 1 and shape[lead + i] != 1
    )
    expected = data.sum(axis=axes, keepdims=True).reshape(target)
    assert_close(out, expected, rtol=1e-14)
    assert await ag.gradcheck(lambda t: sum_to_size(t, target), (x,))
    assert await ag.gradgradcheck(lambda t: sum_to_size(t, target), (x,))
