"""Every op of the table (``tests/ops/test_op_table.py``) and the fused CUDA kernels, on a
real GPU: the results and gradients on ``cuda:0`` equal the CPU's (float64, so the two differ
only by summation order), and the fused kernels equal the generic code and torch CUDA.

Skips without CuPy and a visible GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import aioautograd as ag
from aioautograd.devices import cuda
from tests.helpers import assert_close, to_numpy
from tests.ops import test_op_table as table

pytestmark = [
    pytest.mark.skipif(not cuda.is_available(), reason="CuPy with a visible GPU is required"),
    pytest.mark.timeout(120),
]

F = ag.nn.functional
GPU = "cuda:0"


def _on(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the table's index tensors on ``device`` (its builders call ``_idx``)."""
    monkeypatch.setattr(
        table, "_idx", lambda *v: ag.tensor(np.asarray(v, dtype=np.int64), device=device)
    )


async def _run(
    case: table.Case, device: str, arrays: tuple[Any, ...], create_graph: bool
) -> tuple[list[Any], list[Any], list[Any]]:
    """Outputs, first-order gradients and (under ``create_graph``, for twice-differentiable
    cases) the gradients of ``sum(grads * v)``, all as NumPy arrays."""
    leaves = [ag.tensor(a.copy(), device=device, requires_grad=True) for a in arrays]
    outs = case.build(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    rng = np.random.default_rng(1)
    grad_outputs = [
        ag.tensor(rng.standard_normal(o.shape) + 0.5, dtype=o.dtype, device=o.device) for o in outs
    ]
    grads = await ag.grad(
        list(outs),
        leaves,
        grad_outputs,
        create_graph=create_graph,
        allow_unused=True,
        materialize_grads=True,
    )
    for leaf, g in zip(leaves, grads, strict=True):
        assert g.device is leaf.device, f"gradient on {g.device}, its input on {leaf.device}"
    second: list[Any] = []
    if create_graph and case.second_order:
        weights = [
            ag.tensor(rng.standard_normal(g.shape), dtype=g.dtype, device=g.device) for g in grads
        ]
        total = sum(
            ((g * w).sum() for g, w in zip(grads, weights, strict=True) if g.requires_grad),
            ag.tensor(0.0, dtype=np.float64, device=device),
        )
        if total.requires_grad:
            second = [
                to_numpy(g)
                for g in await ag.grad([total], leaves, allow_unused=True, materialize_grads=True)
            ]
    return [to_numpy(o) for o in outs], [to_numpy(g) for g in grads], second


@pytest.mark.parametrize("create_graph", [False, True], ids=["plain", "create_graph"])
@pytest.mark.parametrize("name", list(table.CASES))
async def test_op_on_cuda_matches_cpu(
    name: str, create_graph: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = table.CASES[name]
    for arrays in (case.inputs, case.boundary):
        if arrays is None:
            continue
        expected = await _run(case, "cpu", arrays, create_graph)
        _on(GPU, monkeypatch)
        actual = await _run(case, GPU, arrays, create_graph)
        monkeypatch.undo()
        for what, got, want in zip(
            ("outputs", "gradients", "second order"), actual, expected, strict=True
        ):
            assert len(got) == len(want), what
            for g, w in zip(got, want, strict=True):
                assert g.dtype == w.dtype, what
                np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12, err_msg=what)


# ------------------------------------------------------------------ the fused kernels


def _torch_cuda() -> Any:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this torch build sees no GPU")
    return torch


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(37, 10), (5, 1000), (1, 1)])
async def test_fused_cross_entropy_matches_cpu_and_torch(
    shape: tuple[int, int], reduction: str, dtype: Any
) -> None:
    rows, classes = shape
    rng = np.random.default_rng(rows + classes)
    logits = (rng.standard_normal(shape) * 3).astype(dtype)
    target = rng.integers(0, classes, rows)
    target[::4] = -100  # ignored rows
    g = rng.standard_normal(() if reduction != "none" else rows).astype(dtype) + 1
    results = {}
    for dev in ("cpu", GPU):
        x = ag.tensor(logits, device=dev, requires_grad=True)
        loss = F.cross_entropy(x, ag.tensor(target, device=dev), reduction=reduction)
        await loss.backward(ag.tensor(g, device=dev))
        assert x.grad.device is ag.device(dev)
        results[dev] = (to_numpy(loss), to_numpy(x.grad))
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == np.float32 else {"rtol": 1e-12, "atol": 1e-12}
    for got, want in zip(results[GPU], results["cpu"], strict=True):
        assert got.dtype == want.dtype
        assert_close(got, want, **tol)
    torch = _torch_cuda()
    tx = torch.tensor(logits, device="cuda", requires_grad=True)
    tl = torch.nn.functional.cross_entropy(
        tx, torch.tensor(target, device="cuda"), reduction=reduction
    )
    tl.backward(torch.tensor(g, device="cuda"))
    assert_close(results[GPU][0], tl.detach(), **tol)
    assert_close(results[GPU][1], tx.grad, **tol)


async def test_fused_cross_entropy_nan_inf_and_bad_targets() -> None:
    logits = np.array(
        [[1.0, np.nan, 0.0], [-np.inf, 0.0, 1.0], [1.0, 2.0, 3.0], [-np.inf, 0.0, 1.0]],
        np.float32,
    )
    target = np.array([0, 1, 2, 0])  # the last row's target is -inf: an infinite loss
    got, want = [], []
    for dev, out in ((GPU, got), ("cpu", want)):
        x = ag.tensor(logits, device=dev, requires_grad=True)
        loss = F.cross_entropy(x, ag.tensor(target, device=dev), reduction="none")
        await loss.sum().backward()
        out.extend([to_numpy(loss), to_numpy(x.grad)])
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)  # NaN where the CPU has NaN
    # A class index out of range: NaN on the GPU (no host check), as documented.
    x = ag.tensor(logits[2:3], device=GPU, requires_grad=True)
    loss = F.cross_entropy(x, ag.tensor([7], device=GPU))
    await loss.backward()
    assert np.isnan(to_numpy(loss))
    assert np.isnan(to_numpy(x.grad)).all()
    # Every row ignored: the mean is NaN (0/0), its gradient 0 (as the CPU's, and torch's).
    finite = np.repeat(logits[2:3], 2, axis=0)
    x = ag.tensor(finite, device=GPU, requires_grad=True)
    loss = F.cross_entropy(x, ag.tensor([-100, -100], device=GPU))
    await loss.backward()
    assert np.isnan(to_numpy(loss))
    cpu = ag.tensor(finite, requires_grad=True)
    cpu_loss = F.cross_entropy(cpu, ag.tensor([-100, -100]))
    await cpu_loss.backward()
    np.testing.assert_array_equal(to_numpy(x.grad), to_numpy(cpu.grad))
    np.testing.assert_array_equal(to_numpy(x.grad), np.zeros((2, 3)))


async def test_fused_cross_entropy_double_backward_matches_cpu() -> None:
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((6, 5))
    target = np.array([0, 4, 2, -100, 1, 3])
    results = {}
    for dev in ("cpu", GPU):
        x = ag.tensor(logits, device=dev, requires_grad=True)
        loss = F.cross_entropy(x, ag.tensor(target, device=dev))
        (g,) = await ag.grad([loss], [x], create_graph=True)
        (gg,) = await ag.grad([(g * g).sum()], [x])
        results[dev] = (to_numpy(g), to_numpy(gg))
    for got, want in zip(results[GPU], results["cpu"], strict=True):
        assert_close(got, want, rtol=1e-10, atol=1e-12)


async def test_fused_relu_backward_matches_cpu_with_nan() -> None:
    data = np.array([-1.0, 0.0, 2.0, np.nan, -0.0, 3.0], np.float32)
    grads = {}
    for dev in ("cpu", GPU):
        x = ag.tensor(data, device=dev, requires_grad=True)
        await F.relu(x).backward(ag.tensor(np.arange(6, dtype=np.float32) + 1, device=dev))
        grads[dev] = to_numpy(x.grad)
    np.testing.assert_array_equal(grads[GPU], grads["cpu"])


@pytest.mark.parametrize("alpha", [-0.5, 2.0])
def test_fused_add_scaled_matches_cpu(alpha: float) -> None:
    rng = np.random.default_rng(0)
    base, other = rng.standard_normal((4, 5)), rng.standard_normal(5)
    results = {}
    for dev in ("cpu", GPU):
        x = ag.tensor(base, device=dev)
        x.add_(ag.tensor(other, device=dev), alpha=alpha)  # broadcast
        x.sub_(x, alpha=alpha)  # the same array on both sides
        y = ag.tensor(np.arange(8.0), device=dev)
        y[1:].add_(y[:-1], alpha=alpha)  # overlapping views: read before written
        z = ag.tensor(base.astype(np.float32), device=dev)
        z.add_(ag.tensor(other, device=dev), alpha=alpha)  # float64 into float32
        results[dev] = [to_numpy(t) for t in (x, y, z)]
    for got, want in zip(results[GPU], results["cpu"], strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)


# ----------------------------------------------- checkpointing and saved-tensor hooks


async def test_checkpoint_non_reentrant_on_cuda_matches_plain() -> None:
    rng = np.random.default_rng(5)
    w = rng.standard_normal((8, 8))

    def block(h: ag.Tensor, weight: ag.Tensor) -> ag.Tensor:
        return F.layer_norm(F.relu(h @ weight), 8).exp().sum(-1)

    x_data = rng.standard_normal((4, 8))
    grads = []
    for use_checkpoint in (False, True):
        x = ag.tensor(x_data, device=GPU, requires_grad=True)
        weight = ag.tensor(w, device=GPU, requires_grad=True)
        out = (
            ag.checkpoint(block, x, weight, use_reentrant=False)
            if use_checkpoint
            else block(x, weight)
        )
        await out.sum().backward()
        grads.append((to_numpy(x.grad), to_numpy(weight.grad)))
    for got, want in zip(grads[1], grads[0], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


async def test_saved_tensors_offloaded_to_the_host_and_back() -> None:
    rng = np.random.default_rng(6)
    data = rng.standard_normal((5, 4))
    packed_devices = []

    def pack(t: ag.Tensor) -> Any:
        packed_devices.append(str(t.device))
        return (t.device, t.detach().cpu())

    def unpack(packed: Any) -> ag.Tensor:
        device, host = packed
        return host.to(device)

    results = []
    for hooks in (False, True):
        x = ag.tensor(data, device=GPU, requires_grad=True)
        if hooks:
            with ag.graph.saved_tensors_hooks(pack, unpack):
                y = (x.exp() * x).std(0).sum() + x.cumsum(1).norm()
        else:
            y = (x.exp() * x).std(0).sum() + x.cumsum(1).norm()
        await y.backward()
        results.append(to_numpy(x.grad))
    assert packed_devices
    assert set(packed_devices) == {GPU}
    np.testing.assert_allclose(results[1], results[0], rtol=1e-12, atol=1e-12)


def test_reductions_to_bool_on_cuda() -> None:
    data = np.array([[0.0, 1.0], [2.0, 3.0]])
    x = ag.tensor(data, device=GPU)
    for name in ("all", "any"):
        for dim in (None, 0, 1):
            got = getattr(x, name)() if dim is None else getattr(x, name)(dim)
            want = getattr(data, name)() if dim is None else getattr(data, name)(dim)
            assert got.device is ag.device(GPU)
            np.testing.assert_array_equal(to_numpy(got), want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(256, 1024), (4096, 10), (3, 5, 7), (1, 1)])
async def test_fused_bias_gradient_matches_cpu(shape: tuple[int, ...], dtype: Any) -> None:
    """The sum of a broadcast gradient over its leading dimensions (``x + b``'s ``b``)."""
    rng = np.random.default_rng(len(shape))
    x_data = rng.standard_normal(shape).astype(dtype)
    b_data = rng.standard_normal(shape[-1]).astype(dtype)
    g = rng.standard_normal(shape).astype(dtype)
    grads = {}
    for dev in ("cpu", GPU):
        x = ag.tensor(x_data, device=dev, requires_grad=True)
        b = ag.tensor(b_data, device=dev, requires_grad=True)
        await (x + b).backward(ag.tensor(g, device=dev))
        assert b.grad.device is ag.device(dev)
        grads[dev] = to_numpy(b.grad)
    assert grads[GPU].dtype == grads["cpu"].dtype
    exact = g.astype(np.float64).reshape(-1, shape[-1]).sum(0)
    if dtype == np.float32:  # summed in double, rounded once; the CPU's float32 sum drifts
        np.testing.assert_allclose(grads[GPU], exact, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(grads[GPU], grads["cpu"], rtol=1e-5, atol=1e-3)
    else:
        np.testing.assert_allclose(grads[GPU], exact, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(grads[GPU], grads["cpu"], rtol=1e-12, atol=1e-12)
