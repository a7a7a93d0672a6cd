"""Tests for ``aioautograd.ops.unary``: values against NumPy, gradients against finite
differences (first and second order) and everything against ``torch.autograd``."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest

import aioautograd as ag
from aioautograd.ops import _erf as _erf_module
from aioautograd.ops.unary import erf
from tests.helpers import assert_close, to_numpy

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _any(x: np.ndarray) -> np.ndarray:
    return x


def _positive(x: np.ndarray) -> np.ndarray:
    return np.abs(x) + 0.5


def _away_from_zero(x: np.ndarray) -> np.ndarray:
    # abs and relu have a kink at 0: keep finite differences off it.
    return np.where(x >= 0, x + 0.2, x - 0.2)


def _away_from_bounds(x: np.ndarray) -> np.ndarray:
    # clamp(-0.5, 0.5) has kinks at the bounds.
    return np.where(np.abs(np.abs(x) - 0.5) < 0.1, x + 0.3, x)


class Case(NamedTuple):
    fn: Callable[[ag.Tensor], ag.Tensor]
    reference: Callable[[np.ndarray], np.ndarray]
    torch_fn: Callable[[Any, Any], Any]  # (torch, tensor) -> tensor
    domain: Callable[[np.ndarray], np.ndarray]
    node: str


CASES: dict[str, Case] = {
    "exp": Case(ag.exp, np.exp, lambda torch, t: t.exp(), _any, "ExpBackward0"),
    "log": Case(ag.log, np.log, lambda torch, t: t.log(), _positive, "LogBackward0"),
    "sqrt": Case(ag.sqrt, np.sqrt, lambda torch, t: t.sqrt(), _positive, "SqrtBackward0"),
    "abs": Case(ag.abs, np.abs, lambda torch, t: t.abs(), _away_from_zero, "AbsBackward0"),
    "sin": Case(ag.sin, np.sin, lambda torch, t: t.sin(), _any, "SinBackward0"),
    "cos": Case(ag.cos, np.cos, lambda torch, t: t.cos(), _any, "CosBackward0"),
    "tanh": Case(ag.tanh, np.tanh, lambda torch, t: t.tanh(), _any, "TanhBackward0"),
    "sigmoid": Case(
        ag.sigmoid,
        lambda x: 1 / (1 + np.exp(-x)),
        lambda torch, t: t.sigmoid(),
        _any,
        "SigmoidBackward0",
    ),
    "relu": Case(
        ag.relu,
        lambda x: np.maximum(x, 0),
        lambda torch, t: t.relu(),
        _away_from_zero,
        "ReluBackward0",
    ),
    "erf": Case(erf, _erf, lambda torch, t: torch.erf(t), _any, "ErfBackward0"),
    "gelu": Case(
        ag.gelu,
        lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2))),
        lambda torch, t: torch.nn.functional.gelu(t),
        _any,
        "GeluBackward0",
    ),
    "gelu_tanh": Case(
        lambda x: ag.gelu(x, approximate="tanh"),
        lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
        lambda torch, t: torch.nn.functional.gelu(t, approximate="tanh"),
        _any,
        "GeluBackward0",
    ),
    "clamp": Case(
        lambda x: ag.clamp(x, -0.5, 0.5),
        lambda x: np.clip(x, -0.5, 0.5),
        lambda torch, t: t.clamp(-0.5, 0.5),
        _away_from_bounds,
        "ClampBackward1",
    ),
    "clamp_min": Case(
        lambda x: ag.clamp(x, min=-0.5),
        lambda x: np.maximum(x, -0.5),
        lambda torch, t: t.clamp(min=-0.5),
        _away_from_bounds,
        "ClampBackward1",
    ),
    "clamp_max": Case(
        lambda x: ag.clamp(x, max=0.5),
        lambda x: np.minimum(x, 0.5),
        lambda torch, t: t.clamp(max=0.5),
        _away_from_bounds,
        "ClampBackward1",
    ),
}
SHAPES = [(), (4,), (2, 3)]


def _data(name: str, shape: tuple[int, ...]) -> np.ndarray:
    return CASES[name].domain(np.random.default_rng(len(shape)).standard_normal(shape))


def _leaf(data: np.ndarray, device: str) -> ag.Tensor:
    return ag.tensor(data, dtype="float64", device=device, requires_grad=True)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", CASES)
def test_values_match_numpy(name: str, shape: tuple[int, ...], device: str) -> None:
    data = _data(name, shape)
    out = CASES[name].fn(ag.tensor(data, device=device))
    assert out.shape == shape
    assert out.dtype == np.float64
    assert out.device == ag.device(device)
    assert_close(out, CASES[name].reference(data), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", CASES)
async def test_gradcheck(name: str, shape: tuple[int, ...], device: str) -> None:
    x = _leaf(_data(name, shape), device)
    assert await ag.gradcheck(CASES[name].fn, (x,))


@pytest.mark.parametrize("name", CASES)
async def test_gradgradcheck(name: str, device: str) -> None:
    x = _leaf(_data(name, (2, 3)), device)
    assert await ag.gradgradcheck(CASES[name].fn, (x,))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", CASES)
async def test_matches_torch(name: str, shape: tuple[int, ...], device: str, torch: Any) -> None:
    data = _data(name, shape)
    x, t = _leaf(data, device), torch.tensor(data, requires_grad=True)
    out, expected = CASES[name].fn(x), CASES[name].torch_fn(torch, t)
    assert_close(out, expected, rtol=1e-13, atol=1e-15)
    assert out.grad_fn is not None
    assert out.grad_fn.name() == CASES[name].node == expected.grad_fn.name()
    seed = np.random.default_rng(7).standard_normal(shape)
    await out.backward(ag.tensor(seed, device=device))
    expected.backward(torch.tensor(seed))
    assert_close(x.grad, t.grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", CASES)
async def test_second_derivative_matches_torch(name: str, device: str, torch: Any) -> None:
    data = _data(name, (5,))
    x, t = _leaf(data, device), torch.tensor(data, requires_grad=True)
    (g,) = await ag.grad(CASES[name].fn(x).sum(), x, create_graph=True)
    (tg,) = torch.autograd.grad(CASES[name].torch_fn(torch, t).sum(), t, create_graph=True)
    assert_close(g, tg, rtol=1e-12, atol=1e-14)
    # Same graph structure: clamp's gradient is a constant mask times grad in both.
    assert g.requires_grad == tg.requires_grad
    if not tg.requires_grad:
        return
    weights = np.linspace(-1.0, 1.0, 5)
    (gg,) = await ag.grad((g * ag.tensor(weights, device=device)).sum(), x)
    (tgg,) = torch.autograd.grad((tg * torch.tensor(weights)).sum(), t)
    # PyTorch returns a ZeroTensor where the second derivative vanishes (abs).
    assert_close(gg, tgg.detach().numpy(force=True), rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("name", CASES)
async def test_float32_stays_float32(name: str, device: str) -> None:
    x = ag.tensor(_data(name, (3,)).astype(np.float32), device=device, requires_grad=True)
    out = CASES[name].fn(x)
    assert out.dtype == np.float32
    await out.sum().backward()
    assert x.grad is not None
    assert x.grad.dtype == np.float32


@pytest.mark.parametrize("name", CASES)
def test_no_graph_under_no_grad(name: str, device: str) -> None:
    x = _leaf(_data(name, (3,)), device)
    with ag.no_grad():
        out = CASES[name].fn(x)
    assert out.grad_fn is None
    assert not out.requires_grad


# ----------------------------------------------------------- non-differentiable points


@pytest.mark.parametrize(
    ("fn", "torch_fn", "values"),
    [
        (ag.abs, lambda torch, t: t.abs(), [0.0, -0.0, -1.5, 2.0]),
        (ag.relu, lambda torch, t: t.relu(), [0.0, -0.0, -1.5, 2.0]),
        # clamp: the gradient flows at the bounds themselves, NaN passes through.
        (lambda x: ag.clamp(x, -1, 1), lambda torch, t: t.clamp(-1, 1), [-1.0, 1.0, -2, 2, 0.5]),
        (lambda x: ag.clamp(x, min=1), lambda torch, t: t.clamp(min=1), [1.0, 0.0, 2.0]),
        (lambda x: ag.clamp(x, max=1), lambda torch, t: t.clamp(max=1), [1.0, 0.0, 2.0]),
        # min > max: everything becomes max and no gradient flows.
        (lambda x: ag.clamp(x, 1, -1), lambda torch, t: t.clamp(1, -1), [-2.0, -1.0, 0.0, 2.0]),
        (lambda x: ag.clamp(x, -1, 1), lambda torch, t: t.clamp(-1, 1), [math.nan, 0.0]),
        (ag.relu, lambda torch, t: t.relu(), [math.nan, 1.0]),
        (ag.sqrt, lambda torch, t: t.sqrt(), [1.0, 4.0]),
    ],
)
async def test_kinks_and_specials_match_torch(
    fn: Callable[[ag.Tensor], ag.Tensor],
    torch_fn: Callable[[Any, Any], Any],
    values: list[float],
    device: str,
    torch: Any,
) -> None:
    data = np.array(values)
    x, t = _leaf(data, device), torch.tensor(data, requires_grad=True)
    out, expected = fn(x), torch_fn(torch, t)
    np.testing.assert_array_equal(to_numpy(out), to_numpy(expected))
    await out.sum().backward()
    expected.sum().backward()
    np.testing.assert_array_equal(to_numpy(x.grad), to_numpy(t.grad))


async def test_relu_gradient_is_zero_at_zero(device: str) -> None:
    x = _leaf(np.array([0.0, 1.0, -1.0]), device)
    await ag.relu(x).sum().backward()
    np.testing.assert_array_equal(to_numpy(x.grad), [0.0, 1.0, 0.0])


async def test_clamp_gradient_flows_at_the_bounds(device: str) -> None:
    x = _leaf(np.array([-1.0, -1.0 - 1e-12, 1.0, 1.0 + 1e-12]), device)
    await ag.clamp(x, -1.0, 1.0).sum().backward()
    np.testing.assert_array_equal(to_numpy(x.grad), [1.0, 0.0, 1.0, 0.0])


def test_clamp_needs_a_bound() -> None:
    with pytest.raises(ValueError, match="At least one of 'min' or 'max'"):
        ag.clamp(ag.zeros(3))


def test_gelu_rejects_unknown_approximation() -> None:
    with pytest.raises(ValueError, match="none or tanh"):
        ag.gelu(ag.zeros(3), approximate="erf")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- numerics


async def test_sigmoid_saturates_without_overflow(torch: Any) -> None:
    data = np.array([-1000.0, -40.0, 0.0, 40.0, 1000.0])
    x, t = _leaf(data, "cpu"), torch.tensor(data, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = ag.sigmoid(x)
        await out.sum().backward()
    expected = t.sigmoid()
    expected.sum().backward()
    assert_close(out, expected, rtol=1e-15, atol=0)
    assert_close(x.grad, t.grad, rtol=1e-15, atol=0)


def test_erf_is_accurate_to_float64() -> None:
    grid = np.concatenate([np.linspace(-7, 7, 20001), np.geomspace(1e-300, 30, 2000)])
    grid = np.concatenate([grid, -grid])
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        out = erf(ag.tensor(grid)).data
    expected = _erf(grid)
    np.testing.assert_allclose(out, expected, rtol=2e-15, atol=0)


def test_erf_special_values() -> None:
    special = [math.inf, -math.inf, math.nan, -0.0, 0.0, 1e308]
    out = erf(ag.tensor(special, dtype="float64")).data
    np.testing.assert_array_equal(out[[0, 1, 4, 5]], [1.0, -1.0, 0.0, 1.0])
    assert math.isnan(out[2])
    assert math.copysign(1.0, out[3]) == -1.0


# Cody's interval boundaries, each with its neighbours on either side.
_ERF_EDGES = [
    v
    for edge in (0.46875, 4.0, 27.0)
    for v in (np.nextafter(edge, 0.0), edge, np.nextafter(edge, np.inf))
]


class _NotNumpy:
    """NumPy under another name: ``erf`` takes the branch-free path of other array modules."""

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)


def test_erf_evaluates_each_interval_on_its_own_elements_only() -> None:
    # Every interval in one array, mixed in any order, with the values that fall outside
    # all three (inf, nan) and subnormals.
    rng = np.random.default_rng(3)
    values = np.concatenate(
        [
            rng.normal(0.0, 4.0, 5000),
            _ERF_EDGES,
            np.negative(_ERF_EDGES),
            [0.0, -0.0, 5e-324, -5e-324, 1e-300, 30.0, -30.0, math.inf, -math.inf, math.nan],
        ]
    )
    rng.shuffle(values)
    out = _erf_module.erf(np, values)
    finite = ~np.isnan(values)
    np.testing.assert_allclose(out[finite], _erf(values[finite]), rtol=2e-15, atol=0)
    assert np.isnan(out[~finite]).all()
    assert np.array_equal(np.signbit(out[finite]), np.signbit(values[finite]))
    # The same values, element for element, as all three intervals evaluated everywhere.
    assert np.array_equal(out, _erf_module.erf(_NotNumpy(), values), equal_nan=True)


@pytest.mark.parametrize(
    "values",
    [
        np.array(0.25),  # 0-d, small
        np.array(3.0),  # 0-d, middle interval
        np.array(-math.inf),  # 0-d, past the last one
        np.array([0.1, -0.2, 0.3]),  # all small: no gather
        np.array([[0.1, 2.0], [-9.0, math.nan]]),  # 2-d, mixed
    ],
)
def test_erf_keeps_shape_and_matches_math_erf(values: np.ndarray) -> None:
    out = _erf_module.erf(np, values)
    assert out.shape == values.shape
    assert out.dtype == np.float64
    expected = np.where(np.isnan(values), math.nan, _erf(np.nan_to_num(values)))
    np.testing.assert_allclose(out, expected, rtol=2e-15, atol=0)


def test_erf_keeps_float32_and_integer_inputs_become_float64() -> None:
    values = np.array([0.2, 1.5, -6.0, 0.46875], dtype=np.float32)
    out = _erf_module.erf(np, values)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, _erf(values.astype(np.float64)), rtol=1e-6)
    integers = _erf_module.erf(np, np.array([-3, 0, 1, 5]))
    assert integers.dtype == np.float64
    np.testing.assert_allclose(integers, _erf(np.array([-3.0, 0.0, 1.0, 5.0])), rtol=2e-15)


async def test_gelu_matches_torch_across_the_erf_intervals(torch: Any) -> None:
    rng = np.random.default_rng(4)
    edges = np.array(_ERF_EDGES) * math.sqrt(2)  # gelu reads erf(x / sqrt(2))
    data = np.concatenate([rng.normal(0.0, 5.0, 3000), edges, -edges, [0.0, 1e-300, -1e-300]])
    x, t = _leaf(data, "cpu"), torch.tensor(data, requires_grad=True)
    out = ag.gelu(x)
    expected = torch.nn.functional.gelu(t)
    assert_close(out, expected, rtol=1e-13, atol=1e-300)
    await out.sum().backward()
    expected.sum().backward()
    assert_close(x.grad, t.grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
async def test_gelu_tails_match_torch(approximate: str, torch: Any) -> None:
    data = np.array([-40.0, -10.0, -5.0, 5.0, 10.0, 40.0])
    x, t = _leaf(data, "cpu"), torch.tensor(data, requires_grad=True)
    out = ag.gelu(x, approximate=approximate)  # type: ignore[arg-type]
    expected = torch.nn.functional.gelu(t, approximate=approximate)
    assert_close(out, expected, rtol=1e-13, atol=1e-300)
    await out.sum().backward()
    expected.sum().backward()
    # Both sides cancel 1 + tanh(inner) ~ 0 in the far left tail: allow rounding noise.
    assert_close(x.grad, t.grad, rtol=1e-12, atol=1e-15)


# ----------------------------------------------------------------- wiring and graph


def test_tensor_methods_route_to_the_ops() -> None:
    data = np.array([0.3, -1.2, 2.0])
    x = ag.tensor(data)
    assert_close(abs(x), np.abs(data))
    assert_close(x.abs(), np.abs(data))
    assert_close(x.clamp(min=0.0), np.maximum(data, 0))
    assert_close(x.clip(-1.0, 1.0), np.clip(data, -1, 1))
    for method in ("exp", "sin", "cos", "tanh", "sigmoid", "relu"):
        assert_close(getattr(x, method)(), getattr(ag, method)(x))
    positive = ag.tensor(np.abs(data))
    assert_close(positive.log(), np.log(np.abs(data)))
    assert_close(positive.sqrt(), np.sqrt(np.abs(data)))


async def test_saved_output_modified_in_place_raises() -> None:
    x = _leaf(np.array([0.1, 0.2]), "cpu")
    y = ag.tanh(x)  # tanh saves its output
    y.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        await y.sum().backward()


async def test_chain_of_unary_ops_matches_torch(torch: Any) -> None:
    data = np.array([[0.3, -1.2, 2.0], [0.7, 0.1, -0.4]])
    x, t = _leaf(data, "cpu"), torch.tensor(data, requires_grad=True)
    out = ag.gelu(ag.sin(x) * ag.sigmoid(x)).tanh().clamp(-0.2, 0.2) + ag.sqrt(ag.abs(x) + 1)
    expected = (
        torch.nn.functional.gelu(t.sin() * t.sigmoid()).tanh().clamp(-0.2, 0.2)
        + (t.abs() + 1).sqrt()
    )
    assert_close(out, expected, rtol=1e-13)
    await out.sum().backward()
    expected.sum().backward()
    assert_close(x.grad, t.grad, rtol=1e-12)


async def test_relu_gradient_keeps_non_finite_incoming_gradients_exact() -> None:
    # The fast masked product must not turn inf * 0 into NaN where the mask is off.
    x = ag.tensor([-1.0, 2.0, -3.0, 4.0], dtype="float64", requires_grad=True)
    y = ag.relu(x)
    await y.backward(ag.tensor([np.inf, np.inf, np.nan, 1.0], dtype="float64"))
    assert x.grad is not None
    np.testing.assert_array_equal(x.grad.numpy(), [0.0, np.inf, 0.0, 1.0])


async def test_where_with_zero_branch_keeps_non_finite_values_exact() -> None:
    cond = ag.tensor([True, False, True])
    values = ag.tensor([np.inf, np.nan, 2.0], dtype="float64")
    np.testing.assert_array_equal(ag.where(cond, values, 0.0).numpy(), [np.inf, 0.0, 2.0])
    np.testing.assert_array_equal(ag.where(cond, 0.0, values).numpy(), [0.0, np.nan, 0.0])


@pytest.mark.parametrize("size", [6, 2048, 2049, 5000])
@pytest.mark.parametrize("owned", [True, False], ids=["owned", "held"])
async def test_relu_gradient_on_both_sides_of_the_masked_copy_size(
    size: int, owned: bool, torch: Any
) -> None:
    # Small gradients are zeroed with one masked copy, large ones by the product with the
    # mask: both keep PyTorch's values at zero, NaN outputs and non-finite gradients, in
    # place into an owned gradient and into a fresh array for one held elsewhere.
    rng = np.random.default_rng(size)
    data = rng.standard_normal(size)
    data[::5] = 0.0
    data[1::97] = np.nan
    gradient = rng.standard_normal(size)
    gradient[2::31] = np.inf
    gradient[3::37] = -np.inf
    gradient[4::41] = np.nan
    x, t = _leaf(data, "cpu"), torch.tensor(data, requires_grad=True)
    incoming = ag.tensor(gradient.copy())
    held = [] if owned else [incoming]
    await ag.relu(x).backward(held[0] if held else ag.tensor(gradient.copy()))
    t.relu().backward(torch.tensor(gradient))
    np.testing.assert_array_equal(to_numpy(x.grad), to_numpy(t.grad))
    np.testing.assert_array_equal(incoming.numpy(), gradient)  # a held gradient is untouched
