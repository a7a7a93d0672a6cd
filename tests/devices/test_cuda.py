"""CUDA through CuPy: runs only where CuPy sees a GPU (skips with a reason otherwise)."""

from __future__ import annotations

import numpy as np
import pytest

import aioautograd as ag
from aioautograd.devices import cuda
from tests.helpers import assert_close

pytestmark = pytest.mark.skipif(
    not cuda.is_available(), reason="CuPy with a visible GPU is required"
)


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


async def test_mlp_gradients_match_cpu_and_torch() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    w1 = rng.standard_normal((32, 8)).astype(np.float32) * 0.3
    w2 = rng.standard_normal((4, 32)).astype(np.float32) * 0.3
    target = rng.integers(0, 4, 16)
    grads = {}
    for dev in ("cpu", "cuda:0"):
        p1 = ag.tensor(w1, device=dev, requires_grad=True)
        p2 = ag.tensor(w2, device=dev, requires_grad=True)
        logits = ag.nn.functional.linear(
            ag.nn.functional.relu(ag.nn.functional.linear(ag.tensor(x, device=dev), p1)), p2
        )
        loss = ag.nn.functional.cross_entropy(logits, ag.tensor(target, device=dev))
        await loss.backward()
        grads[dev] = (p1.grad.cpu().numpy(), p2.grad.cpu().numpy())
    assert_close(grads["cuda:0"][0], grads["cpu"][0], rtol=1e-4, atol=1e-5)
    assert_close(grads["cuda:0"][1], grads["cpu"][1], rtol=1e-4, atol=1e-5)
    if torch.cuda.is_available():
        t1 = torch.tensor(w1, device="cuda", requires_grad=True)
        t2 = torch.tensor(w2, device="cuda", requires_grad=True)
        out = torch.nn.functional.linear(
            torch.relu(torch.nn.functional.linear(torch.tensor(x, device="cuda"), t1)), t2
        )
        torch.nn.functional.cross_entropy(out, torch.tensor(target, device="cuda")).backward()
        assert_close(grads["cuda:0"][0], t1.grad, rtol=1e-4, atol=1e-5)


async def test_two_user_streams_give_correct_gradients() -> None:
    from aioautograd.devices import new_stream, stream

    s1, s2 = new_stream("cuda:0"), new_stream("cuda:0")
    data = np.random.default_rng(1).standard_normal((512, 512))
    x = ag.tensor(data, device="cuda:0", requires_grad=True)
    with stream(s1):
        a = (x @ x).tanh()
    with stream(s2):
        b = (x * 3).exp()
    loss = (a + b).sum()
    await loss.backward()
    expected_x = ag.tensor(data, requires_grad=True)
    await ((expected_x @ expected_x).tanh() + (expected_x * 3).exp()).sum().backward()
    assert_close(x.grad.cpu().numpy(), expected_x.grad.numpy(), rtol=1e-6, atol=1e-6)
