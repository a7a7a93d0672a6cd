"""The array formulas of the hot backward nodes agree with their tensor formulas.

A few backward formulas compute on the arrays when nothing is recorded (grad mode off, a
plain backward) and on tensors under ``create_graph=True``: ``*``, ``@``, ReLU, sum and
mean (their broadcast back) and cross entropy with class indices; so does the input
buffer's sum of the gradients arriving at one input. STYLE §10: a second path needs a
mechanical test holding the two equal. Here each case is differentiated both ways and the
gradients must agree bitwise, on boundary inputs (zeros at ReLU's kink, scalar operands,
broadcasting, ignored targets, fan-in), in float64 and float32, independently of torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import aioautograd as ag
from aioautograd.nn import functional
from tests.helpers import to_numpy

Build = Callable[[list[ag.Tensor]], ag.Tensor]


def _arrays(rng: np.random.Generator, dtype: str, *shapes: tuple[int, ...]) -> list[Any]:
    return [rng.standard_normal(shape).astype(dtype) for shape in shapes]


def _with_zeros(array: Any) -> Any:
    out = array.copy()
    out.flat[::3] = 0.0  # ReLU's kink (and exact zeros for the products)
    return out


def _targets(rows: int, classes: int, ignore: bool) -> ag.Tensor:
    target = np.arange(rows, dtype=np.int64) % classes
    if ignore:
        target[::2] = -100
    return ag.tensor(target)


# name -> (leaf shapes, build, whether the leaves get zeros)
CASES: dict[str, tuple[tuple[tuple[int, ...], ...], Build, bool]] = {
    "mul": (((2, 3), (2, 3)), lambda t: t[0] * t[1], True),
    "mul_broadcast": (((2, 3), (3,)), lambda t: t[0] * t[1], False),
    "mul_scalar": (((2, 3),), lambda t: t[0] * 2.5, False),
    "rmul_int": (((2, 3),), lambda t: 3 * t[0], False),
    "mul_same": (((4,),), lambda t: t[0] * t[0], True),
    "matmul": (((3, 4), (4, 2)), lambda t: t[0] @ t[1], False),
    "matmul_batched": (((2, 3, 4), (4, 5)), lambda t: t[0] @ t[1], False),
    "relu": (((3, 4),), lambda t: t[0].relu(), True),
    "sum": (((2, 3, 4),), lambda t: t[0].sum(), False),
    "sum_dim": (((2, 3, 4),), lambda t: t[0].sum(1), False),
    "sum_keepdim": (((2, 3, 4),), lambda t: t[0].sum((0, 2), keepdim=True), False),
    "mean_dim": (((2, 3, 4),), lambda t: t[0].mean(-1), False),
    "mean_0d": (((),), lambda t: t[0].mean(), False),
    # Three gradients summed in one input buffer (the engine adds the arrays when nothing
    # is recorded, and records old + grad under create_graph).
    "fan_in": (((2, 3),), lambda t: t[0] * 2.0 + t[0] * t[0] + t[0].relu(), True),
    "cross_entropy": (
        ((5, 4),),
        lambda t: functional.cross_entropy(t[0], _targets(5, 4, ignore=False)),
        False,
    ),
    "cross_entropy_ignored": (
        ((6, 3),),
        lambda t: functional.cross_entropy(t[0], _targets(6, 3, ignore=True)),
        False,
    ),
    "cross_entropy_sum": (
        ((5, 4),),
        lambda t: functional.cross_entropy(t[0], _targets(5, 4, False), reduction="sum"),
        False,
    ),
    "cross_entropy_none": (
        ((5, 4),),
        lambda t: functional.cross_entropy(t[0], _targets(5, 4, False), reduction="none"),
        False,
    ),
}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", list(CASES))
async def test_array_formula_equals_tensor_formula(name: str, dtype: str) -> None:
    shapes, build, zeros = CASES[name]
    rng = np.random.default_rng(0)
    arrays = [_with_zeros(a) if zeros else a for a in _arrays(rng, dtype, *shapes)]
    grads = {}
    for create_graph in (False, True):
        leaves = [ag.tensor(a, requires_grad=True) for a in arrays]
        out = build(leaves)
        same = np.random.default_rng(1)  # the same output gradient both times
        grad_output = ag.tensor(same.standard_normal(out.shape).astype(dtype) + 0.5)
        grads[create_graph] = await ag.grad(out, leaves, grad_output, create_graph=create_graph)
    for plain, recorded in zip(grads[False], grads[True], strict=True):
        assert plain.dtype == recorded.dtype
        assert plain.grad_fn is None
        # The same NumPy operations in the same order: equal to the last bit.
        np.testing.assert_array_equal(to_numpy(plain), to_numpy(recorded))
