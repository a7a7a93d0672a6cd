"""CUDA through CuPy: runs only where CuPy sees a GPU (skips with a reason otherwise).

Besides gradients (against the CPU and torch CUDA), these tests check the stream protocol
on a real device: forward branches on user streams, gradients crossing between the CPU and
the GPU, the event loop serving while the GPU finishes a backward, cancellation, and that
the backward never blocks the host on the GPU (only the completion wait does, on a thread).
A spin kernel (a GPU busy-wait of a chosen length) makes the GPU the slow side, so that each
of these facts shows as an ordering, not a timing.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest

import aioautograd as ag
from aioautograd.devices import cuda, current_stream, new_stream, stream
from tests.helpers import assert_close

pytestmark = [
    pytest.mark.skipif(not cuda.is_available(), reason="CuPy with a visible GPU is required"),
    pytest.mark.timeout(120),
]

F = ag.nn.functional

_SPIN_SOURCE = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def spin(seconds: float) -> Any:
    """Keep the GPU busy for about ``seconds`` on the current stream; return an event
    recorded after it (``done`` is False until the spin has finished)."""
    import cupy

    kernel = cupy.RawKernel(_SPIN_SOURCE, "spin")
    clock_khz = cupy.cuda.Device().attributes["ClockRate"]
    kernel((1,), (1,), (np.int64(clock_khz * 1000 * seconds),))
    done = cupy.cuda.Event(disable_timing=True)
    done.record()
    return done


class SpinOnBackward(ag.Function):
    """The identity, whose backward first keeps the GPU busy for ``seconds``."""

    @staticmethod
    def forward(ctx: Any, x: ag.Tensor, seconds: float) -> ag.Tensor:
        ctx.seconds = seconds
        return x * 1

    @staticmethod
    def backward(ctx: Any, grad: ag.Tensor) -> tuple[ag.Tensor, None]:
        ctx.spin_done = spin(ctx.seconds)
        return grad * 1, None


def test_cpu_path_never_imports_cupy() -> None:
    import subprocess
    import sys

    code = (
        "import sys, asyncio, aioautograd as ag\n"
        "x = ag.randn(3, requires_grad=True)\n"
        "asyncio.run((x * 2).sum().backward())\n"
        "assert 'cupy' not in sys.modules, 'cupy imported on the CPU path'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _mlp_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    w1 = rng.standard_normal((32, 8)).astype(np.float32) * 0.3
    w2 = rng.standard_normal((4, 32)).astype(np.float32) * 0.3
    target = rng.integers(0, 4, 16)
    return x, w1, w2, target


async def test_mlp_gradients_match_cpu_and_torch() -> None:
    x, w1, w2, target = _mlp_data()
    grads = {}
    for dev in ("cpu", "cuda:0"):
        p1 = ag.tensor(w1, device=dev, requires_grad=True)
        p2 = ag.tensor(w2, device=dev, requires_grad=True)
        logits = F.linear(F.relu(F.linear(ag.tensor(x, device=dev), p1)), p2)
        loss = F.cross_entropy(logits, ag.tensor(target, device=dev))
        await loss.backward()
        assert p1.grad.device is ag.device(dev)
        grads[dev] = (p1.grad.cpu().numpy(), p2.grad.cpu().numpy())
    for on_gpu, on_cpu in zip(grads["cuda:0"], grads["cpu"], strict=True):
        assert_close(on_gpu, on_cpu, rtol=1e-4, atol=1e-5)
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this torch build sees no GPU")
    t1 = torch.tensor(w1, device="cuda", requires_grad=True)
    t2 = torch.tensor(w2, device="cuda", requires_grad=True)
    out = torch.nn.functional.linear(
        torch.relu(torch.nn.functional.linear(torch.tensor(x, device="cuda"), t1)), t2
    )
    torch.nn.functional.cross_entropy(out, torch.tensor(target, device="cuda")).backward()
    assert_close(grads["cuda:0"][0], t1.grad, rtol=1e-4, atol=1e-5)
    assert_close(grads["cuda:0"][1], t2.grad, rtol=1e-4, atol=1e-5)


async def test_two_user_streams_give_correct_gradients() -> None:
    device = ag.device("cuda:0")
    s1, s2 = new_stream(device), new_stream(device)
    default = current_stream(device)
    data = np.random.default_rng(1).standard_normal((512, 512)) * 0.05
    x = ag.tensor(data, device=device, requires_grad=True)
    s1.wait_stream(default)  # the branches read x, written on the default stream
    s2.wait_stream(default)
    with stream(s1):
        # The spin makes s1's branch finish long after s2's: a missing wait would show.
        a = SpinOnBackward.apply((x @ x).tanh(), 0.2)
    with stream(s2):
        b = (x * 3).exp()
    default.wait_stream(s1)
    default.wait_stream(s2)
    loss = (a + b).sum()
    assert a.grad_fn.stream == s1
    assert b.grad_fn.stream == s2
    assert loss.grad_fn.stream == default
    await loss.backward()
    expected_x = ag.tensor(data, requires_grad=True)
    await ((expected_x @ expected_x).tanh() + (expected_x * 3).exp()).sum().backward()
    assert_close(x.grad, expected_x.grad, rtol=1e-6, atol=1e-6)
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        tx = torch.tensor(data, device="cuda", requires_grad=True)
        ((tx @ tx).tanh() + (tx * 3).exp()).sum().backward()
        assert_close(x.grad, tx.grad, rtol=1e-6, atol=1e-6)


async def test_gradients_accumulate_across_cpu_and_cuda() -> None:
    device = ag.device("cuda:0")
    rng = np.random.default_rng(2)
    x_data, w_data = rng.standard_normal(64), rng.standard_normal(64)
    x = ag.tensor(x_data, requires_grad=True)  # cpu
    w = ag.tensor(w_data, device=device, requires_grad=True)
    side = new_stream(device)
    side.wait_stream(current_stream(device))
    with stream(side):  # w's accumulator lives on the side stream
        on_gpu = SpinOnBackward.apply(x.cuda() * w, 0.1)  # x's gradient comes back from cuda
        w_squares = (w.cpu() ** 2).sum()  # w's gradient is copied to cuda by a cpu node
    current_stream(device).wait_stream(side)
    loss = on_gpu.sum().cpu() + (x * 3).sum() + w_squares
    await loss.backward()
    assert x.grad.device is ag.device("cpu")
    assert w.grad.device is device
    assert_close(x.grad, w_data + 3)
    assert_close(w.grad, x_data + 2 * w_data)


async def test_backward_never_blocks_the_host_on_the_gpu() -> None:
    """Every node of the backward is issued while the GPU still runs a spin kernel queued
    before them: no node waited for the GPU (an implicit sync would have waited out the
    spin). The completion wait does wait: after ``await backward()`` the spin is over."""
    x_data, w1, w2, target = _mlp_data()
    device = ag.device("cuda:0")
    params = [ag.tensor(w, device=device, requires_grad=True) for w in (w1, w2)]
    inputs, targets = ag.tensor(x_data, device=device), ag.tensor(target, device=device)

    def loss_fn() -> ag.Tensor:
        hidden = F.relu(F.linear(inputs, params[0]))
        logits = F.linear(ag.maximum(hidden, 0.01 * hidden), params[1])
        return F.cross_entropy(logits, targets)

    await loss_fn().backward()  # warm-up: kernels compiled, memory pool grown
    expected = [p.grad.cpu().numpy() * 2 for p in params]
    loss = loss_fn()
    spin_done = spin(0.5)
    gpu_busy_at_leaf: list[bool] = []

    def at_leaf(_: ag.Tensor) -> None:
        gpu_busy_at_leaf.append(not spin_done.done)

    for p in params:
        p.register_post_accumulate_grad_hook(at_leaf)
    await loss.backward()
    assert gpu_busy_at_leaf == [True, True]
    assert spin_done.done
    for p, grad in zip(params, expected, strict=True):
        assert_close(p.grad, grad, rtol=1e-5, atol=1e-6)


async def test_event_loop_serves_while_a_large_gpu_backward_finishes(
    record_property: Any,
) -> None:
    """A 1 ms ticker keeps ticking while ``await backward()`` waits for the GPU: the
    completion wait runs on a thread. Its lateness is recorded, not asserted."""
    device = ag.device("cuda:0")
    rng = np.random.default_rng(3)
    size = 4096
    weights = [
        ag.tensor(rng.standard_normal((size, size)).astype(np.float32) / size**0.5, device=device)
        for _ in range(8)
    ]
    x = ag.tensor(
        rng.standard_normal((size, size)).astype(np.float32), device=device, requires_grad=True
    )
    h = x
    for w in weights:
        h = (h @ w).tanh()
    h = SpinOnBackward.apply(h, 0.3)
    loss = h.sum()
    backward = asyncio.ensure_future(loss.backward())
    lateness: list[float] = []
    ticks_while_pending = 0
    while not backward.done():
        start = time.perf_counter()
        await asyncio.sleep(0.001)
        lateness.append(time.perf_counter() - start - 0.001)
        ticks_while_pending += not backward.done()
    await backward
    spin_node = h.grad_fn
    assert spin_node.spin_done.done  # the GPU finished before backward returned
    assert x.grad is not None
    assert np.isfinite(x.grad.cpu().numpy()).all()
    # The loop ticked while the backward was pending (it waited out a 0.3 s spin).
    assert ticks_while_pending >= 2
    lateness_ms = sorted(1e3 * value for value in lateness)
    record_property("ticks", len(lateness_ms))
    record_property("max_lateness_ms", round(lateness_ms[-1], 3))
    record_property("p99_lateness_ms", round(lateness_ms[int(0.99 * (len(lateness_ms) - 1))], 3))
    print(
        f"1 ms ticker during the backward: {len(lateness_ms)} ticks, lateness "
        f"median {lateness_ms[len(lateness_ms) // 2]:.3f} ms, max {lateness_ms[-1]:.3f} ms"
    )


class Gate(ag.Function):
    """The identity, whose backward waits until the test opens the gate."""

    entered = threading.Event()
    release = threading.Event()

    @staticmethod
    def forward(ctx: Any, x: ag.Tensor) -> ag.Tensor:
        return x * 1

    @staticmethod
    def backward(ctx: Any, grad: ag.Tensor) -> ag.Tensor:
        Gate.entered.set()
        if not Gate.release.wait(30):
            raise TimeoutError("the gate was never opened")
        return grad * 1


async def test_cancelling_a_gpu_backward() -> None:
    device = ag.device("cuda:0")
    side = new_stream(device)
    x = ag.tensor(np.arange(6.0), device=device, requires_grad=True)
    side.wait_stream(current_stream(device))
    with stream(side):
        loss = (Gate.apply(x * 2) ** 2).sum()
    Gate.entered.clear()
    Gate.release.clear()
    task = asyncio.ensure_future(loss.backward())
    await asyncio.to_thread(Gate.entered.wait, 30)  # the backward is stuck in the gate
    task.cancel()
    Gate.release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert x.grad is None  # the nodes after the gate never ran
    # The engine (and its CUDA executor) still serves the next pass.
    with stream(side):
        loss = (Gate.apply(x * 2) ** 2).sum()
    await loss.backward()
    assert_close(x.grad, 8 * np.arange(6.0))
