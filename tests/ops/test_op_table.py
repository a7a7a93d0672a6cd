"""Every differentiable op, one table (Chainer's ``FunctionTestCase``), independent of torch.

Each case builds a small graph out of one op (a few need a helper op around them) and is run
four ways:

- forward: the output equals a NumPy reference;
- backward: the gradients equal central finite differences (``gradcheck``), on inputs away
  from the op's kinks;
- double backward: the gradients of the gradients equal finite differences
  (``gradgradcheck``) where the op is twice differentiable;
- plain == create_graph: on inputs that sit on the piecewise boundaries (zeros for ReLU and
  abs, ties for max/min, clamp bounds, zero factors), the gradients of a plain backward and
  those of a ``create_graph=True`` backward are equal to the last bit, and they equal the
  subgradient PyTorch documents (written out below, not computed by torch).

Several hot ops compute their first-order gradient on the arrays when nothing is recorded
and on tensors under ``create_graph``; the last check holds the two formulas together.
``test_table_covers_every_op`` walks the forward graphs and the ``create_graph`` gradient
graphs of all cases and fails when an op class of the package is in none of them: a new op
must bring its row.

Without torch (``python -m pytest -p tests.no_torch tests/ops/test_op_table.py``) every test
here still runs.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import aioautograd as ag
from aioautograd.autograd.node import Node
from aioautograd.function import Function
from aioautograd.nn import functional as F
from aioautograd.ops import conv, embedding, indexing, reduction, unary
from aioautograd.ops._util import Op
from tests.helpers import to_numpy

Array = np.ndarray[Any, Any]


def _r(*shape: int, seed: int = 0, low: float | None = None, high: float | None = None) -> Array:
    rng = np.random.default_rng(seed + 17 * len(shape) + sum(shape))
    if low is not None and high is not None:
        return rng.uniform(low, high, shape)
    return rng.standard_normal(shape)


def _a(*values: Any) -> Array:
    return np.asarray(values, dtype=np.float64)


def _idx(*values: Any) -> Any:
    return ag.tensor(np.asarray(values, dtype=np.int64))


@dataclass(frozen=True)
class Case:
    """One row: ``build(*tensors)`` returns the output (or a tuple of outputs).

    ``inputs`` are float64 arrays away from kinks (finite differences are valid there);
    ``reference`` is the forward in NumPy on the same arrays. ``boundary`` are inputs on the
    piecewise boundaries and ``expected`` the gradients there for an output gradient of ones,
    as PyTorch defines the subgradient (``None``: only plain == create_graph is checked there).
    ``finite_differences=False`` where the defined gradient is not the derivative
    (``padding_idx``); ``second_order=False`` where the op is not twice differentiable.
    """

    build: Callable[..., Any]
    inputs: tuple[Array, ...]
    reference: Callable[..., Any] | None = None
    boundary: tuple[Array, ...] | None = None
    expected: tuple[Array, ...] | None = None
    second_order: bool = True
    finite_differences: bool = True
    gradcheck: dict[str, float] = field(default_factory=dict)


def _softmax(x: Array, axis: int) -> Array:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _erf(x: Array) -> Array:
    import math

    return np.vectorize(math.erf)(x)


def _inplace(method: str, *args: Any) -> Callable[..., Any]:
    def build(x: ag.Tensor, *others: ag.Tensor) -> ag.Tensor:
        y = x.clone()  # a leaf may not be modified in place
        getattr(y, method)(*others, *args)
        return y

    return build


def _setitem_advanced(x: ag.Tensor, v: ag.Tensor) -> ag.Tensor:
    y = x.clone()  # a leaf may not be modified in place
    y[_idx(0, 2)] = v
    return y


def _put(v: Array) -> Array:
    out = np.zeros(4)
    out[[0, 2]] = v
    return out


_CONV_X, _CONV_W = _r(1, 2, 4, 4), _r(3, 2, 2, 2, seed=1)
# A 2x2 kernel over a 3x3 input padded by 1: each input pixel lies in four windows.
_GEOMETRY = conv.ConvGeometry(
    input_shape=(1, 1, 3, 3),
    kernel=(2, 2),
    stride=(1, 1),
    padding=((1, 1), (1, 1)),
    dilation=(1, 1),
    output=(4, 4),
)


def _conv_reference(x: Array, w: Array, b: Array) -> Array:
    out = np.zeros((1, 3, 3, 3))
    for i in range(3):
        for j in range(3):
            patch = x[:, :, i : i + 2, j : j + 2]
            out[:, :, i, j] = np.einsum("nchw,ochw->no", patch, w)
    return out + b[None, :, None, None]


CASES: dict[str, Case] = {
    # ------------------------------------------------------------------ arithmetic
    "add": Case(lambda a, b: a + b, (_r(2, 3), _r(3)), np.add),
    "sub": Case(lambda a, b: a - b, (_r(2, 3), _r(2, 1)), np.subtract),
    "rsub": Case(lambda a: 2.0 - a, (_r(2, 3),), lambda a: 2.0 - a),
    "mul": Case(
        lambda a, b: a * b,
        (_r(2, 3), _r(2, 3, seed=1)),
        np.multiply,
        boundary=(_a(0.0, 2.0, 0.0, -1.0), _a(3.0, 0.0, 0.0, 4.0)),
        expected=(_a(3.0, 0.0, 0.0, 4.0), _a(0.0, 2.0, 0.0, -1.0)),
    ),
    "mul_broadcast_scalar": Case(lambda a, b: (a * b) * 2.5, (_r(2, 3), _r(3, seed=1))),
    "div": Case(lambda a, b: a / b, (_r(2, 3), _r(2, 3, low=0.5, high=2.0)), np.divide),
    "rdiv": Case(lambda a: 2.0 / a, (_r(3, low=0.5, high=2.0),), lambda a: 2.0 / a),
    "pow_scalar": Case(
        lambda a: a**3,
        (_r(4),),
        lambda a: a**3,
        boundary=(_a(0.0, -1.0, 2.0),),
        expected=(_a(0.0, 3.0, 12.0),),
    ),
    "pow_zero_exponent": Case(
        lambda a: a**0, (_r(3),), lambda a: a**0, boundary=(_a(0.0, 1.0),), expected=(_a(0, 0),)
    ),
    "pow_tensor": Case(
        lambda a, b: a**b,
        (_r(3, low=0.5, high=2.0), _r(3, seed=1)),
        np.power,
        # 0 ** 0: d/da is 0 where the exponent is 0, d/db is 0 where the base is 0 (b >= 0).
        boundary=(_a(0.0, 2.0), _a(0.0, 0.0)),
        expected=(_a(0.0, 0.0), _a(0.0, np.log(2.0))),
    ),
    "pow_scalar_base": Case(lambda b: 2.0**b, (_r(3),), lambda b: 2.0**b),
    "neg": Case(lambda a: -a, (_r(3),), np.negative),
    "maximum": Case(
        lambda a, b: ag.maximum(a, b),
        (_a(0.3, -1.0, 2.0), _a(0.1, 0.5, -2.0)),
        np.maximum,
        boundary=(_a(1.0, 2.0, 3.0), _a(1.0, 0.0, 4.0)),
        expected=(_a(0.5, 1.0, 0.0), _a(0.5, 0.0, 1.0)),
    ),
    "minimum": Case(
        lambda a, b: ag.minimum(a, b),
        (_a(0.3, -1.0, 2.0), _a(0.1, 0.5, -2.0)),
        np.minimum,
        boundary=(_a(1.0, 2.0, 3.0), _a(1.0, 0.0, 4.0)),
        expected=(_a(0.5, 0.0, 1.0), _a(0.5, 1.0, 0.0)),
    ),
    "where": Case(
        lambda a, b: ag.where(a > 0, a, b),
        (_a(0.3, -1.0, 2.0), _a(0.1, 0.5, -2.0)),
        lambda a, b: np.where(a > 0, a, b),
        boundary=(_a(0.0, 1.0), _a(5.0, 6.0)),
        expected=(_a(0.0, 1.0), _a(1.0, 0.0)),
    ),
    # ----------------------------------------------------------------------- unary
    "clone": Case(lambda a: a.clone(), (_r(3),), lambda a: a),
    "copy_grad": Case(lambda a: a._copy_grad(), (_r(3),), lambda a: a),
    "cast": Case(
        lambda a: a.float().double(),
        (_r(3),),
        lambda a: a.astype(np.float32).astype(np.float64),
        gradcheck={"eps": 1e-3, "atol": 1e-3},
    ),
    "to_device": Case(lambda a: a.to("sim:1").to("cpu"), (_r(3),), lambda a: a),
    "exp": Case(lambda a: a.exp(), (_r(3),), np.exp),
    "log": Case(lambda a: a.log(), (_r(3, low=0.5, high=2.0),), np.log),
    "sqrt": Case(lambda a: a.sqrt(), (_r(3, low=0.5, high=2.0),), np.sqrt),
    "abs": Case(
        lambda a: a.abs(),
        (_a(-1.5, 0.5, 2.0),),
        np.abs,
        boundary=(_a(-1.0, 0.0, 2.0),),
        expected=(_a(-1.0, 0.0, 1.0),),
    ),
    "sign": Case(
        lambda a: unary.sign(a) * a,  # sign alone has no gradient to compare
        (_a(-1.5, 0.5, 2.0),),
        lambda a: np.sign(a) * a,
        boundary=(_a(-1.0, 0.0, 2.0),),
        expected=(_a(-1.0, 0.0, 1.0),),
    ),
    "sin": Case(lambda a: a.sin(), (_r(3),), np.sin),
    "cos": Case(lambda a: a.cos(), (_r(3),), np.cos),
    "tanh": Case(lambda a: a.tanh(), (_r(3),), np.tanh),
    "sigmoid": Case(lambda a: a.sigmoid(), (_r(3),), lambda a: 1 / (1 + np.exp(-a))),
    "relu": Case(
        lambda a: a.relu(),
        (_a(-1.5, 0.5, 2.0, -0.3),),
        lambda a: np.maximum(a, 0),
        # PyTorch: relu'(0) = 0 (threshold_backward passes where the output is > 0).
        boundary=(_a(-1.0, 0.0, 2.0),),
        expected=(_a(0.0, 0.0, 1.0),),
    ),
    "erf": Case(lambda a: unary.erf(a), (_r(4),), _erf),
    "gelu": Case(lambda a: F.gelu(a), (_r(4),), lambda a: 0.5 * a * (1 + _erf(a / np.sqrt(2)))),
    "gelu_tanh": Case(lambda a: F.gelu(a, approximate="tanh"), (_r(4),)),
    "clamp": Case(
        lambda a: a.clamp(-1.0, 1.0),
        (_a(-1.5, -0.5, 0.5, 1.5),),
        lambda a: np.clip(a, -1.0, 1.0),
        # PyTorch: the gradient passes where min <= x <= max, the bounds included.
        boundary=(_a(-2.0, -1.0, 0.0, 1.0, 2.0),),
        expected=(_a(0.0, 1.0, 1.0, 1.0, 0.0),),
    ),
    # ------------------------------------------------------------------- reductions
    "sum": Case(
        lambda a: a.sum(),
        (_r(2, 3),),
        np.sum,
        boundary=(np.zeros((2, 3)),),
        expected=(np.ones((2, 3)),),
    ),
    "sum_dim": Case(lambda a: a.sum(1), (_r(2, 3, 4),), lambda a: a.sum(1)),
    # Square: a gradient broadcast back along the wrong axis would fit the shape.
    "sum_dim_square": Case(lambda a: a.sum(1), (_r(3, 3),), lambda a: a.sum(1)),
    "sum_keepdim": Case(
        lambda a: a.sum((0, 2), keepdim=True),
        (_r(2, 3, 4),),
        lambda a: a.sum((0, 2), keepdims=True),
    ),
    "mean": Case(
        lambda a: a.mean(),
        (_r(2, 3),),
        np.mean,
        boundary=(np.zeros((2, 3)),),
        expected=(np.full((2, 3), 1 / 6),),
    ),
    "mean_dim": Case(lambda a: a.mean(-1), (_r(2, 3),), lambda a: a.mean(-1)),
    "mean_dim_square": Case(lambda a: a.mean(0), (_r(3, 3),), lambda a: a.mean(0)),
    "max": Case(
        lambda a: a.max(),
        (_a(0.3, 2.0, -1.0),),
        np.max,
        # PyTorch: a full max splits the gradient evenly among the ties.
        boundary=(_a(3.0, 1.0, 3.0, 0.0),),
        expected=(_a(0.5, 0.0, 0.5, 0.0),),
    ),
    "min": Case(
        lambda a: a.min(),
        (_a(0.3, 2.0, -1.0),),
        np.min,
        boundary=(_a(-3.0, 1.0, -3.0, -3.0),),
        expected=(_a(1 / 3, 0.0, 1 / 3, 1 / 3),),
    ),
    "max_dim": Case(
        lambda a: a.max(1).values,
        (_r(2, 3),),
        lambda a: a.max(1),
        # Along a dim the gradient goes to the returned index (the first maximum).
        boundary=(_a([3.0, 1.0, 3.0], [0.0, 2.0, 2.0]),),
        expected=(_a([1.0, 0.0, 0.0], [0.0, 1.0, 0.0]),),
    ),
    "min_dim": Case(
        lambda a: a.min(0, keepdim=True).values,
        (_r(2, 3),),
        lambda a: a.min(0, keepdims=True),
        boundary=(_a([1.0, -1.0], [1.0, 2.0]),),
        expected=(_a([1.0, 1.0], [0.0, 0.0]),),
    ),
    "var": Case(lambda a: a.var(1), (_r(2, 4),), lambda a: a.var(1, ddof=1)),
    "logsumexp": Case(
        lambda a: a.logsumexp(1),
        (_r(2, 3),),
        lambda a: np.log(np.exp(a).sum(1)),
    ),
    "softmax": Case(lambda a: a.softmax(1), (_r(2, 3),), lambda a: _softmax(a, 1)),
    "log_softmax": Case(lambda a: a.log_softmax(1), (_r(2, 3),), lambda a: np.log(_softmax(a, 1))),
    # ------------------------------------------------------------------------ linalg
    "matmul": Case(
        lambda a, b: a @ b,
        (_r(3, 4), _r(4, 2, seed=1)),
        np.matmul,
        boundary=(np.zeros((2, 2)), _a([1.0, 2.0], [3.0, 4.0])),
        expected=(_a([3.0, 7.0], [3.0, 7.0]), np.zeros((2, 2))),
    ),
    "matmul_batched": Case(lambda a, b: a @ b, (_r(2, 3, 4), _r(4, 5, seed=1)), np.matmul),
    "matmul_vector": Case(lambda a, b: a @ b, (_r(3, 4), _r(4, seed=1)), np.matmul),
    "dot": Case(lambda a, b: a @ b, (_r(4), _r(4, seed=1)), np.matmul),
    # ------------------------------------------------------------------------- shape
    "reshape": Case(lambda a: a.reshape(3, 2), (_r(2, 3),), lambda a: a.reshape(3, 2)),
    "expand": Case(lambda a: a.expand(2, 3), (_r(1, 3),), lambda a: np.broadcast_to(a, (2, 3))),
    "permute": Case(lambda a: a.permute(1, 0), (_r(2, 3),), lambda a: a.T),
    "cat": Case(
        lambda a, b: ag.cat([a, b], 1), (_r(2, 3), _r(2, 1)), lambda a, b: np.concatenate([a, b], 1)
    ),
    "stack": Case(
        lambda a, b: ag.stack([a, b]), (_r(3), _r(3, seed=1)), lambda a, b: np.stack([a, b])
    ),
    "split": Case(lambda a: a.split(2, 1), (_r(2, 5),)),
    "split_sizes": Case(lambda a: a.split([1, 4], 1), (_r(2, 5),)),
    "unbind": Case(lambda a: a.unbind(0), (_r(2, 3),)),
    # ---------------------------------------------------------------------- indexing
    "getitem": Case(lambda a: a[1:, ::2], (_r(3, 4),), lambda a: a[1:, ::2]),
    "index": Case(
        lambda a: a[np.array([0, 2, 0])],
        (_r(3, 2),),
        lambda a: a[[0, 2, 0]],
        # A repeated index accumulates.
        boundary=(np.zeros((3, 2)),),
        expected=(_a([2.0, 2.0], [0.0, 0.0], [1.0, 1.0]),),
    ),
    "gather": Case(
        lambda a: a.gather(1, _idx([0, 0], [2, 1])),
        (_r(2, 3),),
        lambda a: np.take_along_axis(a, np.array([[0, 0], [2, 1]]), 1),
        boundary=(np.zeros((2, 3)),),
        expected=(_a([2.0, 0.0, 0.0], [0.0, 1.0, 1.0]),),
    ),
    "index_select": Case(
        lambda a: a.index_select(0, _idx(1, 1, 0)),
        (_r(2, 3),),
        lambda a: a[[1, 1, 0]],
        boundary=(np.zeros((2, 3)),),
        expected=(np.ones((2, 3)) * _a([1.0], [2.0]),),
    ),
    "cumsum": Case(lambda a: a.cumsum(1), (_r(2, 3),), lambda a: np.cumsum(a, axis=1)),
    "norm": Case(
        lambda a: a.norm(),
        (_r(2, 3),),
        lambda a: np.sqrt((a * a).sum()),
        boundary=(np.zeros((2, 3)),),
        expected=(np.zeros((2, 3)),),
    ),
    "norm_p3_dim": Case(
        lambda a: a.norm(3, dim=1),
        (_r(2, 3),),
        lambda a: (np.abs(a) ** 3).sum(axis=1) ** (1 / 3),
    ),
    "norm_inf": Case(lambda a: a.norm(np.inf, dim=1), (_r(2, 3),), lambda a: np.abs(a).max(axis=1)),
    # ----------------------------------------------------------------------- in place
    "add_": Case(_inplace("add_", 2.0), (_r(3), _r(3, seed=1)), lambda a, b: a + 2 * b),
    "mul_": Case(_inplace("mul_"), (_r(3), _r(3, seed=1)), np.multiply),
    "zero_": Case(lambda a: _inplace("zero_")(a) + a, (_r(3),), lambda a: a),
    "copy_": Case(_inplace("copy_"), (_r(3), _r(3, seed=1)), lambda a, b: b),
    "exp_": Case(_inplace("exp_"), (_r(3),), np.exp),
    "relu_": Case(
        _inplace("relu_"),
        (_a(-1.5, 0.5, 2.0, -0.3),),
        lambda a: np.maximum(a, 0),
        boundary=(_a(-1.0, 0.0, 2.0),),
        expected=(_a(0.0, 0.0, 1.0),),
    ),
    "fill_": Case(lambda a: _inplace("fill_", 2.0)(a) + a, (_r(3),), lambda a: 2.0 + a),
    "setitem_advanced": Case(
        _setitem_advanced,
        (_r(4), _r(2, seed=1)),
        lambda x, v: np.where([1, 0, 1, 0], 0, x) + _put(v),
    ),
    # ------------------------------------------------------------------- nn.functional
    "linear": Case(
        lambda x, w, b: F.linear(x, w, b),
        (_r(2, 3, 4), _r(5, 4, seed=1), _r(5, seed=2)),
        lambda x, w, b: x @ w.T + b,
    ),
    "cross_entropy": Case(
        lambda x: F.cross_entropy(x, _idx(0, 2, 1, 2)),
        (_r(4, 3),),
        lambda x: -np.log(_softmax(x, 1))[np.arange(4), [0, 2, 1, 2]].mean(),
    ),
    "cross_entropy_ignored": Case(
        lambda x: F.cross_entropy(x, _idx(0, -100, 1, 2), reduction="sum"),
        (_r(4, 3),),
        lambda x: -np.log(_softmax(x, 1))[[0, 2, 3], [0, 1, 2]].sum(),
    ),
    "cross_entropy_probabilities": Case(
        lambda x, t: F.cross_entropy(x, t.softmax(1)),
        (_r(2, 3), _r(2, 3, seed=1)),
        lambda x, t: -(np.log(_softmax(x, 1)) * _softmax(t, 1)).sum(1).mean(),
    ),
    "embedding": Case(
        lambda w: F.embedding(_idx([0, 2], [2, 3]), w),
        (_r(4, 2),),
        lambda w: w[[[0, 2], [2, 3]]],
        # A repeated index accumulates.
        boundary=(np.zeros((4, 2)),),
        expected=(_a([1.0, 1.0], [0.0, 0.0], [2.0, 2.0], [1.0, 1.0]),),
    ),
    "embedding_padding": Case(
        lambda w: F.embedding(_idx([0, 2], [2, 3]), w, padding_idx=3),
        (_r(4, 2),),
        lambda w: w[[[0, 2], [2, 3]]],
        # The padding row gets nothing, though the output depends on it.
        boundary=(np.zeros((4, 2)),),
        expected=(_a([1.0, 1.0], [0.0, 0.0], [2.0, 2.0], [0.0, 0.0]),),
        finite_differences=False,
    ),
    "conv2d": Case(
        lambda x, w, b: F.conv2d(x, w, b),
        (_CONV_X, _CONV_W, _r(3, seed=2)),
        _conv_reference,
    ),
    "conv2d_padded_strided": Case(
        lambda x, w: F.conv2d(x, w, stride=2, padding=1), (_CONV_X, _CONV_W)
    ),
    # ------------------------------------------- ops that other ops' backwards apply
    "threshold_backward": Case(
        lambda g, out: unary.ThresholdBackward.apply(g, out),
        (_r(4), _a(0.5, -1.0, 2.0, -0.2)),
        lambda g, out: g * (out > 0),
        boundary=(_a(1.0, 1.0, 1.0), _a(-1.0, 0.0, 2.0)),
        expected=(_a(0.0, 0.0, 1.0), _a(0.0, 0.0, 0.0)),
    ),
    "sum_to_size": Case(
        lambda a: reduction.SumToSize.apply(a, (1, 3)),
        (_r(2, 3),),
        lambda a: a.sum(0, keepdims=True),
    ),
    "index_put_basic": Case(
        lambda g: indexing.IndexPut.apply(g, (3, 4), (slice(1, None), slice(None, None, 2))),
        (_r(2, 2),),
    ),
    "index_put_advanced": Case(
        lambda g: indexing.IndexPut.apply(g, (3, 2), np.array([0, 2, 0])), (_r(3, 2),)
    ),
    "scatter_add": Case(
        lambda src: indexing.ScatterAdd.apply(src, (2, 3), 1, _idx([0, 0], [2, 1])), (_r(2, 2),)
    ),
    "index_add": Case(
        lambda src: indexing.IndexAdd.apply(src, (2, 3), 0, _idx(1, 1, 0)), (_r(3, 3),)
    ),
    "embedding_backward": Case(
        lambda g: embedding.EmbeddingBackward.apply(g, _idx([0, 2], [2, 3]), 4, None),
        (_r(2, 2, 3),),
    ),
    "col2im": Case(
        lambda x: conv.Col2Im.apply(conv.Im2Col.apply(x, _GEOMETRY), _GEOMETRY), (_r(1, 1, 3, 3),)
    ),
    "layer_norm": Case(
        lambda x, w, b: F.layer_norm(x, 3, w, b),
        (_r(2, 3), _r(3, seed=1), _r(3, seed=2)),
        lambda x, w, b: (
            (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * w + b
        ),
    ),
}


def _leaves(arrays: tuple[Array, ...]) -> list[ag.Tensor]:
    return [ag.tensor(a.copy(), requires_grad=True) for a in arrays]


def _outputs(case: Case, leaves: list[ag.Tensor]) -> tuple[ag.Tensor, ...]:
    out = case.build(*leaves)
    return out if isinstance(out, tuple) else (out,)


async def _grads(
    case: Case,
    arrays: tuple[Array, ...],
    create_graph: bool,
    ones: bool,
    grad_outputs_require_grad: bool = False,
) -> tuple[list[Any], list[ag.Tensor]]:
    leaves = _leaves(arrays)
    outs = _outputs(case, leaves)
    rng = np.random.default_rng(1)  # the same output gradients both times
    grad_outputs = [
        ag.tensor(
            np.ones(o.shape) if ones else rng.standard_normal(o.shape) + 0.5,
            requires_grad=grad_outputs_require_grad,
        )
        for o in outs
    ]
    grads = await ag.grad(
        list(outs),
        leaves,
        grad_outputs,
        create_graph=create_graph,
        allow_unused=True,
        materialize_grads=True,
    )
    return list(grads), list(outs)


@pytest.mark.parametrize("name", list(CASES))
def test_forward(name: str) -> None:
    case = CASES[name]
    if case.reference is None:
        pytest.skip("no NumPy reference: composite of ops checked elsewhere in the table")
    outs = _outputs(case, _leaves(case.inputs))
    expected = case.reference(*(a.copy() for a in case.inputs))
    np.testing.assert_allclose(to_numpy(outs[0]), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.finite_differences])
async def test_backward_matches_finite_differences(name: str) -> None:
    case = CASES[name]
    assert await ag.gradcheck(case.build, _leaves(case.inputs), **case.gradcheck)


@pytest.mark.parametrize(
    "name", [n for n, c in CASES.items() if c.second_order and c.finite_differences]
)
async def test_double_backward_matches_finite_differences(name: str) -> None:
    case = CASES[name]
    assert await ag.gradgradcheck(case.build, _leaves(case.inputs), **case.gradcheck)


@pytest.mark.parametrize("name", list(CASES))
async def test_plain_equals_create_graph(name: str) -> None:
    """The plain backward and the create_graph backward agree to the last bit, on the
    boundary inputs where the op has them (and on the smooth ones otherwise)."""
    case = CASES[name]
    arrays = case.boundary if case.boundary is not None else case.inputs
    plain, _ = await _grads(case, arrays, create_graph=False, ones=False)
    recorded, _ = await _grads(case, arrays, create_graph=True, ones=False)
    for p, r in zip(plain, recorded, strict=True):
        assert p.grad_fn is None
        assert p.dtype == r.dtype
        np.testing.assert_array_equal(to_numpy(p), to_numpy(r))


@pytest.mark.parametrize("create_graph", [False, True])
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.expected is not None])
async def test_subgradient_at_boundaries(name: str, create_graph: bool) -> None:
    """At the kinks, ties and bounds the gradient is PyTorch's documented choice."""
    case = CASES[name]
    assert case.boundary is not None
    assert case.expected is not None
    grads, _ = await _grads(case, case.boundary, create_graph=create_graph, ones=True)
    for grad, expected in zip(grads, case.expected, strict=True):
        np.testing.assert_allclose(to_numpy(grad), expected, rtol=1e-12, atol=1e-12)


def _op_node_names() -> set[str]:
    """The node name of every op class of the package (``MulBackward0``, ...)."""
    for module in pkgutil.walk_packages(ag.__path__, "aioautograd."):
        if ".examples" not in module.name and ".distributed" not in module.name:
            importlib.import_module(module.name)
    names = set()
    pending = [Op]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        # Bases: abstract (Op, MultiOutputOp: Function's forward) or private (_Extreme).
        if cls.forward is not Function.forward and not cls.__name__.startswith("_"):
            names.add(cls._backward_cls.__name__)
    return names


def _graph_names(roots: list[Any]) -> Iterator[str]:
    seen: set[int] = set()
    pending = [r for r in roots if r is not None]
    while pending:
        node: Node = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node.name()
        pending.extend(fn for fn, _ in node.next_functions if fn is not None)


async def test_table_covers_every_op() -> None:
    """Every op class appears in the forward or the create_graph gradient graph of a case
    (the output gradients require grad, so that backward-only ops such as ``IndexPut``
    are recorded too)."""
    covered: set[str] = set()
    for case in CASES.values():
        grads, outs = await _grads(
            case, case.inputs, create_graph=True, ones=False, grad_outputs_require_grad=True
        )
        covered.update(_graph_names([o.grad_fn for o in outs]))
        covered.update(_graph_names([g.grad_fn for g in grads]))
    missing = _op_node_names() - covered
    assert not missing, f"ops without a row in tests/ops/test_op_table.py: {sorted(missing)}"


def test_derivative_rules_live_in_ops() -> None:
    """Every op class is defined under ``aioautograd/ops/``: ``nn.functional`` and the rest
    of the package call them (one place per derivative)."""
    _op_node_names()  # imports every module
    outside = []
    pending = [Op]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if not cls.__module__.startswith("aioautograd.ops."):
            outside.append(f"{cls.__module__}.{cls.__qualname__}")
    assert not outside, f"op classes outside aioautograd/ops/: {outside}"
