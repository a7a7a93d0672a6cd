"""Tests for ``aioautograd.ops.arithmetic``: values against NumPy, gradients against finite
differences (first and second order) and everything against ``torch.autograd``, with
broadcasting and Python scalars on either side."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest

import aioautograd as ag
from tests.helpers import assert_close, to_numpy


def _any(x: np.ndarray) -> np.ndarray:
    return x


def _positive(x: np.ndarray) -> np.ndarray:
    return np.abs(x) + 0.5


def _condition(shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(5).random(shape) > 0.5


class Binary(NamedTuple):
    fn: Callable[[Any, Any], ag.Tensor]
    reference: Callable[[np.ndarray, np.ndarray], np.ndarray]
    torch_fn: Callable[[Any, Any, Any], Any]  # (torch, a, b)
    domains: tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]]
    node: str | None  # the node name PyTorch gives (None: not checked)


def _where(a: Any, b: Any) -> ag.Tensor:
    shape = np.broadcast_shapes(np.shape(a.data), np.shape(b.data))
    device = a.device if isinstance(a, ag.Tensor) else b.device
    return ag.where(ag.tensor(_condition(shape), device=device), a, b)


def _torch_where(torch: Any, a: Any, b: Any) -> Any:
    shape = np.broadcast_shapes(tuple(a.shape), tuple(b.shape))
    return torch.where(torch.tensor(_condition(shape)), a, b)


BINARY: dict[str, Binary] = {
    "add": Binary(ag.add, np.add, lambda torch, a, b: a + b, (_any, _any), "AddBackward0"),
    "sub": Binary(ag.sub, np.subtract, lambda torch, a, b: a - b, (_any, _any), "SubBackward0"),
    "mul": Binary(ag.mul, np.multiply, lambda torch, a, b: a * b, (_any, _any), "MulBackward0"),
    "div": Binary(ag.div, np.divide, lambda torch, a, b: a / b, (_any, _positive), "DivBackward0"),
    "pow": Binary(ag.pow, np.power, lambda torch, a, b: a**b, (_positive, _any), "PowBackward1"),
    "maximum": Binary(
        ag.maximum,
        np.maximum,
        lambda torch, a, b: torch.maximum(a, b),
        (_any, _any),
        "MaximumBackward0",
    ),
    "minimum": Binary(
        ag.minimum,
        np.minimum,
        lambda torch, a, b: torch.minimum(a, b),
        (_any, _any),
        "MinimumBackward0",
    ),
    "where": Binary(
        _where,
        lambda a, b: np.where(_condition(np.broadcast_shapes(a.shape, b.shape)), a, b),
        _torch_where,
        (_any, _any),
        "WhereBackward0",
    ),
}
SHAPE_PAIRS = [
    ((), ()),
    ((4,), (4,)),
    ((2, 3), (2, 3)),
    ((2, 3), (3,)),
    ((2, 1), (1, 3)),
    ((), (2, 3)),
    ((2, 3), ()),
    ((3, 1, 2), (3, 1)),
]


def _pair(name: str, shapes: tuple[tuple[int, ...], ...]) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(len(shapes[0]) * 10 + len(shapes[1]))
    da, db = BINARY[name].domains
    return da(rng.standard_normal(shapes[0])), db(rng.standard_normal(shapes[1]))


def _leaf(data: Any, device: str, requires_grad: bool = True) -> ag.Tensor:
    return ag.tensor(data, dtype="float64", device=device, requires_grad=requires_grad)


@pytest.mark.parametrize("shapes", SHAPE_PAIRS, ids=str)
@pytest.mark.parametrize("name", BINARY)
def test_binary_values_match_numpy(
    name: str, shapes: tuple[tuple[int, ...], ...], device: str
) -> None:
    a, b = _pair(name, shapes)
    out = BINARY[name].fn(ag.tensor(a, device=device), ag.tensor(b, device=device))
    expected = BINARY[name].reference(a, b)
    assert out.shape == np.shape(expected)
    assert out.dtype == np.float64
    assert_close(out, expected, rtol=1e-14, atol=0)


@pytest.mark.parametrize("shapes", SHAPE_PAIRS, ids=str)
@pytest.mark.parametrize("name", BINARY)
async def test_binary_gradcheck(
    name: str, shapes: tuple[tuple[int, ...], ...], device: str
) -> None:
    a, b = _pair(name, shapes)
    assert await ag.gradcheck(BINARY[name].fn, (_leaf(a, device), _leaf(b, device)))


# For a * b and a / b the gradient of a does not depend on a: gradgradcheck then also
# covers grad(allow_unused=True) of an input with no path to it.
@pytest.mark.parametrize("shapes", [((2, 3), (3,)), ((), (2,))], ids=str)
@pytest.mark.parametrize("name", BINARY)
async def test_binary_gradgradcheck(
    name: str, shapes: tuple[tuple[int, ...], ...], device: str
) -> None:
    a, b = _pair(name, shapes)
    assert await ag.gradgradcheck(BINARY[name].fn, (_leaf(a, device), _leaf(b, device)))


@pytest.mark.parametrize("shapes", SHAPE_PAIRS, ids=str)
@pytest.mark.parametrize("name", BINARY)
async def test_binary_matches_torch(
    name: str, shapes: tuple[tuple[int, ...], ...], device: str, torch: Any
) -> None:
    a, b = _pair(name, shapes)
    xa, xb = _leaf(a, device), _leaf(b, device)
    ta, tb = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    out, expected = BINARY[name].fn(xa, xb), BINARY[name].torch_fn(torch, ta, tb)
    assert_close(out, expected, rtol=1e-14, atol=0)
    if BINARY[name].node is not None:
        assert out.grad_fn is not None
        assert out.grad_fn.name() == BINARY[name].node == expected.grad_fn.name()
    seed = np.random.default_rng(9).standard_normal(tuple(expected.shape))
    await out.backward(ag.tensor(seed, device=device))
    expected.backward(torch.tensor(seed))
    assert xa.grad is not None
    assert xb.grad is not None
    assert xa.grad.shape == a.shape
    assert xb.grad.shape == b.shape
    assert_close(xa.grad, ta.grad, rtol=1e-13, atol=1e-15)
    assert_close(xb.grad, tb.grad, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("name", BINARY)
async def test_only_inputs_that_require_grad_get_one(name: str, device: str) -> None:
    a, b = _pair(name, ((2, 3), (3,)))
    xa, xb = _leaf(a, device), _leaf(b, device, requires_grad=False)
    await BINARY[name].fn(xa, xb).sum().backward()
    assert xa.grad is not None
    assert xa.grad.shape == (2, 3)
    assert xb.grad is None


# --------------------------------------------------------------- Python scalars


class WithScalar(NamedTuple):
    fn: Callable[[ag.Tensor], ag.Tensor]
    reference: Callable[[np.ndarray], np.ndarray]
    torch_fn: Callable[[Any, Any], Any]
    domain: Callable[[np.ndarray], np.ndarray]


SCALAR: dict[str, WithScalar] = {
    "x+2": WithScalar(lambda x: x + 2, lambda a: a + 2, lambda torch, t: t + 2, _any),
    "2+x": WithScalar(lambda x: 2 + x, lambda a: 2 + a, lambda torch, t: 2 + t, _any),
    "x-2.5": WithScalar(lambda x: x - 2.5, lambda a: a - 2.5, lambda torch, t: t - 2.5, _any),
    "2.5-x": WithScalar(lambda x: 2.5 - x, lambda a: 2.5 - a, lambda torch, t: 2.5 - t, _any),
    "x*3": WithScalar(lambda x: x * 3, lambda a: a * 3, lambda torch, t: t * 3, _any),
    "3*x": WithScalar(lambda x: 3 * x, lambda a: 3 * a, lambda torch, t: 3 * t, _any),
    "x/4": WithScalar(lambda x: x / 4, lambda a: a / 4, lambda torch, t: t / 4, _any),
    "4/x": WithScalar(lambda x: 4 / x, lambda a: 4 / a, lambda torch, t: 4 / t, _positive),
    "x**2": WithScalar(lambda x: x**2, lambda a: a**2, lambda torch, t: t**2, _any),
    "x**3": WithScalar(lambda x: x**3, lambda a: a**3, lambda torch, t: t**3, _any),
    "x**0.5": WithScalar(lambda x: x**0.5, np.sqrt, lambda torch, t: t**0.5, _positive),
    "x**-1.5": WithScalar(
        lambda x: x**-1.5, lambda a: a**-1.5, lambda torch, t: t**-1.5, _positive
    ),
    "2**x": WithScalar(lambda x: 2**x, lambda a: 2.0**a, lambda torch, t: 2**t, _any),
    "-x": WithScalar(lambda x: -x, np.negative, lambda torch, t: -t, _any),
    "neg": WithScalar(ag.neg, np.negative, lambda torch, t: torch.neg(t), _any),
    "maximum(x,0.3)": WithScalar(
        lambda x: ag.maximum(x, 0.3),
        lambda a: np.maximum(a, 0.3),
        lambda torch, t: torch.maximum(t, torch.tensor(0.3, dtype=t.dtype)),
        _any,
    ),
    "minimum(0.3,x)": WithScalar(
        lambda x: ag.minimum(0.3, x),
        lambda a: np.minimum(0.3, a),
        lambda torch, t: torch.minimum(torch.tensor(0.3, dtype=t.dtype), t),
        _any,
    ),
    "where(c,x,1.5)": WithScalar(
        lambda x: ag.where(ag.tensor(_condition(x.shape), device=x.device), x, 1.5),
        lambda a: np.where(_condition(a.shape), a, 1.5),
        lambda torch, t: torch.where(torch.tensor(_condition(tuple(t.shape))), t, 1.5),
        _any,
    ),
    "where(c,-1.5,x)": WithScalar(
        lambda x: ag.where(ag.tensor(_condition(x.shape), device=x.device), -1.5, x),
        lambda a: np.where(_condition(a.shape), -1.5, a),
        lambda torch, t: torch.where(torch.tensor(_condition(tuple(t.shape))), -1.5, t),
        _any,
    ),
}
SHAPES = [(), (4,), (2, 3)]


def _data(name: str, shape: tuple[int, ...]) -> np.ndarray:
    return SCALAR[name].domain(np.random.default_rng(len(shape)).standard_normal(shape))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", SCALAR)
def test_scalar_operand_values_match_numpy(name: str, shape: tuple[int, ...], device: str) -> None:
    data = _data(name, shape)
    out = SCALAR[name].fn(ag.tensor(data, device=device))
    assert isinstance(out, ag.Tensor)
    assert out.shape == shape
    assert out.dtype == np.float64
    assert_close(out, SCALAR[name].reference(data), rtol=1e-14, atol=0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", SCALAR)
async def test_scalar_operand_gradcheck(name: str, shape: tuple[int, ...], device: str) -> None:
    x = _leaf(_data(name, shape), device)
    assert await ag.gradcheck(SCALAR[name].fn, (x,))


@pytest.mark.parametrize("name", SCALAR)
async def test_scalar_operand_gradgradcheck(name: str, device: str) -> None:
    x = _leaf(_data(name, (2, 3)), device)
    assert await ag.gradgradcheck(SCALAR[name].fn, (x,))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", SCALAR)
async def test_scalar_operand_matches_torch(
    name: str, shape: tuple[int, ...], device: str, torch: Any
) -> None:
    data = _data(name, shape)
    x, t = _leaf(data, device), torch.tensor(data, requires_grad=True)
    out, expected = SCALAR[name].fn(x), SCALAR[name].torch_fn(torch, t)
    assert_close(out, expected, rtol=1e-14, atol=0)
    seed = np.random.default_rng(9).standard_normal(shape)
    await out.backward(ag.tensor(seed, device=device))
    expected.backward(torch.tensor(seed))
    assert_close(x.grad, t.grad, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("name", ["x+2", "2.5-x", "3*x", "4/x", "x**2", "2**x", "-x"])
def test_python_scalars_keep_float32(name: str) -> None:
    out = SCALAR[name].fn(ag.tensor(_data(name, (3,)), dtype="float32"))
    assert out.dtype == np.float32


async def test_one_number_in_many_ops_and_dtypes_gives_torchs_values_and_gradients(
    torch: Any,
) -> None:
    # The ops share one 0-d array per number and dtype (ops/_util._number_array): the same
    # number meets float32 then float64 tensors, inside a loop, and signed zeros and NaN
    # (never shared) keep their values.
    c, minus_zero, nan = 1.0001, -0.0, float("nan")
    for dtype in ("float32", "float64"):
        data = np.array([1.5, -2.0, 0.25], dtype=dtype)
        x, t = ag.tensor(data, requires_grad=True), torch.tensor(data, requires_grad=True)
        h, g = x, t
        for _ in range(5):
            h, g = h * c / c * c, g * c / c * c
        np.testing.assert_array_equal(to_numpy(h), g.detach().numpy())
        assert h.dtype == dtype
        await h.sum().backward()
        g.sum().backward()
        np.testing.assert_array_equal(to_numpy(x.grad), t.grad.numpy())
        signed = x * minus_zero, x * 0.0
        np.testing.assert_array_equal(np.signbit(to_numpy(signed[0])), data > 0)
        np.testing.assert_array_equal(np.signbit(to_numpy(signed[1])), data < 0)
        assert np.isnan(to_numpy(x + nan)).all()


def test_a_number_operand_is_one_shared_read_only_array_per_value_and_dtype() -> None:
    from aioautograd.ops._util import _number_array

    f32, f64 = np.dtype(np.float32), np.dtype(np.float64)
    shared = _number_array(3.0, f32)
    assert _number_array(float("3"), f32) is shared  # an equal number, another object
    assert _number_array(3, f32) is shared  # asarray gives the same array for the int
    assert _number_array(3.0, f64) is not shared
    assert _number_array(3.0, f64).dtype == f64
    assert np.signbit(_number_array(-0.0, f64))  # signed zeros are never shared
    assert not np.signbit(_number_array(0.0, f64))
    assert np.isnan(_number_array(float("nan"), f32))
    with pytest.raises(ValueError, match="read-only"):
        shared[...] = 4.0  # shared by every op that met 3.0: nothing may write into it
    assert shared == 3.0


async def test_numpy_array_on_the_left_defers_to_the_tensor(device: str) -> None:
    x = _leaf(np.array([1.0, 2.0]), device)
    out = np.array([3.0, 4.0]) * x
    assert isinstance(out, ag.Tensor)
    await out.sum().backward()
    np.testing.assert_array_equal(to_numpy(x.grad), [3.0, 4.0])


# ------------------------------------------------------------ ties and special points


@pytest.mark.parametrize(
    ("fn", "torch_name"),
    [(ag.maximum, "maximum"), (ag.minimum, "minimum")],
    ids=["maximum", "minimum"],
)
async def test_extremum_ties_split_gradient_like_torch(
    fn: Any, torch_name: str, device: str, torch: Any
) -> None:
    a = np.array([[1.0, 2.0, 3.0], [0.5, 0.5, -1.0]])
    b = np.array([1.0, 3.0, 2.0])  # broadcast; ties at (0, 0) and nowhere else
    xa, xb = _leaf(a, device), _leaf(b, device)
    ta, tb = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    out, expected = fn(xa, xb), getattr(torch, torch_name)(ta, tb)
    np.testing.assert_array_equal(to_numpy(out), to_numpy(expected))
    await out.sum().backward()
    expected.sum().backward()
    np.testing.assert_array_equal(to_numpy(xa.grad), to_numpy(ta.grad))
    np.testing.assert_array_equal(to_numpy(xb.grad), to_numpy(tb.grad))
    assert to_numpy(xa.grad)[0, 0] == 0.5


@pytest.mark.parametrize(
    ("fn", "base", "exponent"),
    [
        (lambda a, b: a**b, [0.0, 1.0, 2.0], [0.5, 2.0, 0.0]),  # 0 ** b and b == 0
        (lambda a, b: a**b, [-2.0, 3.0], [2.0, 0.5]),  # negative base: nan for b's grad
        (lambda a, b: a**b, [0.0, 0.0], [0.0, 3.0]),
    ],
)
async def test_pow_special_points_match_torch(
    fn: Any, base: list[float], exponent: list[float], torch: Any
) -> None:
    a, b = np.array(base), np.array(exponent)
    xa, xb = _leaf(a, "cpu"), _leaf(b, "cpu")
    ta, tb = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    # NumPy warns (divide by zero, invalid value) where PyTorch silently gives inf and nan.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = fn(xa, xb)
        await out.sum().backward()
    expected = fn(ta, tb)
    expected.sum().backward()
    np.testing.assert_array_equal(to_numpy(out), to_numpy(expected))
    np.testing.assert_allclose(to_numpy(xa.grad), to_numpy(ta.grad), rtol=1e-15)
    np.testing.assert_allclose(to_numpy(xb.grad), to_numpy(tb.grad), rtol=1e-15)


@pytest.mark.parametrize(
    ("fn", "data"),
    [
        (lambda x: x**0, [0.0, 1.5, -2.0]),
        (lambda x: x**2, [0.0, -1.0]),
        (lambda x: x**1, [0.0, -1.0]),
        (lambda x: 0.0**x, [0.0, 1.0, 2.0]),
        (lambda x: 1.0**x, [-1.0, 2.0]),
    ],
)
async def test_pow_with_scalar_at_special_points_matches_torch(
    fn: Any, data: list[float], torch: Any
) -> None:
    array = np.array(data)
    x, t = _leaf(array, "cpu"), torch.tensor(array, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = fn(x)
        await out.sum().backward()
    expected = fn(t)
    expected.sum().backward()
    np.testing.assert_array_equal(to_numpy(out), to_numpy(expected))
    np.testing.assert_array_equal(to_numpy(x.grad), to_numpy(t.grad))


async def test_where_broadcasts_condition_and_operands(device: str, torch: Any) -> None:
    condition = np.array([[True], [False]])
    a, b = np.array([1.0, 2.0, 3.0]), np.array(7.0)
    xa, xb = _leaf(a, device), _leaf(b, device)
    out = ag.where(ag.tensor(condition, device=device), xa, xb)
    ta, tb = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    expected = torch.where(torch.tensor(condition), ta, tb)
    np.testing.assert_array_equal(to_numpy(out), to_numpy(expected))
    await out.sum().backward()
    expected.sum().backward()
    np.testing.assert_array_equal(to_numpy(xa.grad), [1.0, 1.0, 1.0])
    assert float(to_numpy(xb.grad)) == 3.0 == float(tb.grad)


def test_where_needs_a_tensor_condition() -> None:
    with pytest.raises(TypeError, match="condition must be a boolean Tensor"):
        ag.where([True, False], ag.zeros(2), ag.ones(2))  # type: ignore[arg-type]


async def test_same_tensor_on_both_sides_accumulates(device: str, torch: Any) -> None:
    data = np.array([0.5, -1.5, 2.0])
    x, t = _leaf(data, device), torch.tensor(data, requires_grad=True)
    out = x * x - x / (x * x + 1) + (x * x + 1) ** x
    expected = t * t - t / (t * t + 1) + (t * t + 1) ** t
    assert_close(out, expected, rtol=1e-14)
    await out.sum().backward()
    expected.sum().backward()
    assert_close(x.grad, t.grad, rtol=1e-13)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_broadcast_mismatch_is_a_runtime_error_naming_the_op(requires_grad: bool, torch) -> None:
    a = ag.randn(3, 4, requires_grad=requires_grad)
    b = ag.randn(5)
    for name, fn, torch_fn in [
        ("add", lambda x, y: x + y, torch.add),
        ("mul", lambda x, y: x * y, torch.mul),
        ("div", lambda x, y: x / y, torch.div),
        ("maximum", ag.maximum, torch.maximum),
    ]:
        with pytest.raises(RuntimeError, match=rf"^{name}: shapes \(3, 4\) and \(5,\)") as info:
            fn(a, b)
        with pytest.raises(RuntimeError) as expected:
            torch_fn(torch.randn(3, 4), torch.randn(5))
        # PyTorch's own sentence is part of the message.
        assert str(expected.value).lower() in str(info.value).lower()
        assert "unsqueeze or expand" in str(info.value)
    assert (a + b[:4]).shape == (3, 4)  # ops keep working afterwards
