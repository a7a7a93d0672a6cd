"""``matmul``: every case of ``numpy.matmul`` (1-D operands, batches, broadcast batch dims)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import aioautograd as ag
from aioautograd.devices.cpu_budget import _blocks_are_exact, cpu_budget
from aioautograd.devices.device import CpuBackend
from tests.helpers import assert_close
from tests.ops.oracle import check_against_torch

SHAPES = [
    ((3,), (3,)),  # dot product: 0-d result
    ((3,), (3, 2)),  # vector @ matrix
    ((2, 3), (3,)),  # matrix @ vector
    ((2, 3), (3, 4)),
    ((3,), (2, 3, 2)),  # vector @ batch of matrices
    ((2, 2, 3), (3,)),  # batch of matrices @ vector
    ((2, 2, 3), (3, 2)),  # batch @ matrix (broadcast)
    ((2, 3), (2, 3, 2)),  # matrix @ batch
    ((2, 1, 2, 3), (3, 3, 2)),  # broadcast batch dims on both sides
    ((1, 2, 3), (2, 3, 1)),
]


def _randn(*shape: int, device: str = "cpu", requires_grad: bool = True) -> ag.Tensor:
    return ag.randn(*shape, dtype="float64", device=device, requires_grad=requires_grad)


@pytest.mark.parametrize(("shape_a", "shape_b"), SHAPES)
async def test_matmul_values_and_grad(
    shape_a: tuple[int, ...], shape_b: tuple[int, ...], device: str
) -> None:
    a, b = _randn(*shape_a, device=device), _randn(*shape_b, device=device)
    y = a @ b
    expected = np.matmul(a.detach().cpu().data, b.detach().cpu().data)
    assert y.shape == expected.shape
    assert isinstance(y.detach().cpu().data, np.ndarray)
    assert_close(y, expected)
    assert y.grad_fn is not None
    assert y.grad_fn.name() == "MatMulBackward0"
    assert await ag.gradcheck(ag.matmul, (a, b))


@pytest.mark.parametrize(
    ("shape_a", "shape_b"),
    [((2,), (2,)), ((2,), (2, 2)), ((2, 2), (2,)), ((2, 1, 2), (2, 1)), ((2,), (2, 2, 1))],
)
async def test_matmul_second_derivative(shape_a: tuple[int, ...], shape_b: tuple[int, ...]) -> None:
    a, b = _randn(*shape_a), _randn(*shape_b)
    # Squared so that each first derivative depends on both operands (it exercises the
    # cross terms of MatMul's own backward).
    assert await ag.gradgradcheck(lambda s, t: (s @ t) ** 2, (a, b))
    assert await ag.gradgradcheck(lambda t: t @ b.detach() * t.sum(), (a,))


@pytest.mark.parametrize(("shape_a", "shape_b"), SHAPES)
async def test_matmul_matches_torch(
    torch: Any, shape_a: tuple[int, ...], shape_b: tuple[int, ...]
) -> None:
    rng = np.random.default_rng(3)
    await check_against_torch(
        torch,
        lambda lib, s, t: lib.matmul(s, t),
        rng.standard_normal(shape_a),
        rng.standard_normal(shape_b),
    )


async def test_matmul_gradient_of_one_operand_only() -> None:
    a = _randn(2, 3)
    b = _randn(3, 4, requires_grad=False)
    await (a @ b).sum().backward()
    assert b.grad is None
    assert a.grad is not None
    assert_close(a.grad, np.ones((2, 4)) @ b.data.T)


async def test_dot_product_gradients() -> None:
    a = ag.tensor([1.0, 2.0, 3.0], dtype="float64", requires_grad=True)
    b = ag.tensor([4.0, 5.0, 6.0], dtype="float64", requires_grad=True)
    y = a @ b
    assert y.shape == ()
    assert y.item() == 32.0
    await (y * 2.0).backward()
    assert a.grad is not None
    assert b.grad is not None
    assert_close(a.grad, [8.0, 10.0, 12.0])
    assert_close(b.grad, [2.0, 4.0, 6.0])


async def test_matmul_with_array_operand() -> None:
    a = _randn(2, 3)
    m = np.arange(6.0).reshape(3, 2)
    y = a @ m
    assert isinstance(y, ag.Tensor)
    assert_close(y, a.detach().data @ m)
    await y.sum().backward()
    assert a.grad is not None
    assert_close(a.grad, np.ones((2, 2)) @ m.T)


def test_matmul_errors() -> None:
    with pytest.raises(RuntimeError, match="at least 1D"):
        ag.matmul(_randn(), _randn(3))
    with pytest.raises(RuntimeError, match="at least 1D"):
        ag.matmul(_randn(3, 2), _randn())
    with pytest.raises(RuntimeError, match="inner dimensions do not match"):
        ag.matmul(_randn(2, 3), _randn(2, 3))
    with pytest.raises(RuntimeError, match="inner dimensions do not match"):
        ag.matmul(_randn(3), _randn(2))


@pytest.fixture
def two_cores_pairing_everything() -> Iterator[Any]:
    """The default engine on two cores that pairs (and splits) products of every size and
    runs no node inline, so that the small products below take the paths (a worker's) that
    the MLP's large ones take."""
    policy = ag.EnginePolicy(cpu_cores=2, intra_op_min_flops=0.0, inline_budget_s=0.0)
    engine = ag.Engine(policy=policy)
    previous = ag.set_default_engine(engine)
    try:
        yield cpu_budget()
    finally:
        assert previous is not None
        ag.set_default_engine(previous)
        engine.close()


async def _linear_grads(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    x = ag.tensor(rng.standard_normal((64, 96)).astype(np.float32), requires_grad=True)
    w = ag.tensor(rng.standard_normal((96, 128)).astype(np.float32), requires_grad=True)
    v = ag.tensor(rng.standard_normal((80, 128)).astype(np.float32), requires_grad=True)
    b = ag.tensor(rng.standard_normal(80).astype(np.float32), requires_grad=True)
    hidden = (x @ w).relu()  # MatMulBackward0: both operands need a gradient
    out = ag.nn.functional.linear(hidden, v, b)  # LinearFunction: input and weight
    await (out * out).sum().backward()
    return [t.grad.data.copy() for t in (x, w, v, b)]  # type: ignore[union-attr]


@pytest.mark.skipif(
    not _blocks_are_exact(np.dtype(np.float32)),
    reason="this BLAS rounds float32 products cut in blocks apart from whole ones: never cut",
)
@pytest.mark.timeout(60)
async def test_backward_pairs_its_two_products_bitwise(
    two_cores_pairing_everything: Any, monkeypatch: pytest.MonkeyPatch, torch: Any
) -> None:
    budget = two_cores_pairing_everything
    before = budget.paired_products
    paired = await _linear_grads(5)
    assert budget.paired_products >= before + 2  # on a worker, a core free for the helper

    def one_after_the_other(backend: Any, a1: Any, b1: Any, a2: Any, b2: Any) -> Any:
        return backend.matmul(a1, b1), backend.matmul(a2, b2)

    monkeypatch.setattr(CpuBackend, "matmul_pair", one_after_the_other)
    sequential = await _linear_grads(5)
    assert all(np.array_equal(p, s) for p, s in zip(paired, sequential, strict=True))
    await check_against_torch(
        torch,
        lambda lib, x, w, v: lib.nn.functional.linear(lib.matmul(x, w).relu(), v),
        *(np.random.default_rng(6).standard_normal(s) for s in ((64, 96), (96, 128), (80, 128))),
    )
