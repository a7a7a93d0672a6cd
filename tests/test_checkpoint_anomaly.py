"""checkpoint (recompute in backward) and anomaly mode."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aioautograd as ag
from tests.helpers import assert_close


def _mlp_params(seed: int) -> list[ag.Tensor]:
    rng = np.random.default_rng(seed)
    return [
        ag.tensor(rng.standard_normal((6, 8)), requires_grad=True),
        ag.tensor(rng.standard_normal((8, 8)), requires_grad=True),
        ag.tensor(rng.standard_normal((8, 1)), requires_grad=True),
    ]


def _block(h: ag.Tensor, w: ag.Tensor) -> ag.Tensor:
    return (h @ w).tanh()


async def test_checkpointed_mlp_matches_plain_gradients() -> None:
    x = ag.tensor(np.random.default_rng(0).standard_normal((5, 6)))
    plain = _mlp_params(1)
    ckpt = _mlp_params(1)
    loss = ((_block(_block(x, plain[0]), plain[1])) @ plain[2]).sum()
    await loss.backward()
    h = ag.checkpoint(_block, x, ckpt[0])
    h = ag.checkpoint(_block, h, ckpt[1])
    loss_ckpt = (h @ ckpt[2]).sum()
    assert_close(loss_ckpt, loss)
    await loss_ckpt.backward()
    for p, q in zip(plain, ckpt, strict=True):
        assert_close(q.grad, p.grad)


async def test_checkpoint_with_closure_parameters() -> None:
    w = ag.randn(3, 3, dtype="float64", requires_grad=True)
    x = ag.randn(2, 3, dtype="float64", requires_grad=True)
    out = ag.checkpoint(lambda t: (t @ w).exp(), x)
    await out.sum().backward()
    expected_w = x.data.T @ np.exp(x.data @ w.data)
    assert_close(w.grad, expected_w)
    assert_close(x.grad, np.exp(x.data @ w.data) @ w.data.T)


async def test_concurrent_checkpointed_graph_tasks() -> None:
    ws = [ag.randn(4, 4, dtype="float64", requires_grad=True) for _ in range(6)]

    async def run(w: ag.Tensor) -> None:
        x = ag.randn(3, 4, dtype="float64", requires_grad=True)
        h = ag.checkpoint(lambda t: (t @ w).tanh(), x)
        h = ag.checkpoint(lambda t: (t @ w).tanh(), h)
        await h.sum().backward()

    await asyncio.wait_for(asyncio.gather(*(run(w) for w in ws)), 30)
    assert all(w.grad is not None and np.isfinite(w.grad.data).all() for w in ws)


class NanBackward(ag.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


async def test_anomaly_nan_check_names_the_node() -> None:
    x = ag.randn(3, requires_grad=True)
    with ag.detect_anomaly():
        y = NanBackward.apply(x * 2).sum()
        with pytest.raises(
            RuntimeError,
            match=r"Function 'NanBackwardBackward' returned nan values "
            r"in its 0th output\.",
        ) as info:
            await y.backward()
    notes = "\n".join(info.value.__notes__)
    assert "MulBackward0" in notes  # the node the NaN gradient was going to
    assert "Traceback of forward call" in notes
    assert "test_anomaly_nan_check_names_the_node" in notes


async def test_nan_is_not_checked_without_anomaly_mode() -> None:
    x = ag.randn(3, requires_grad=True)
    await NanBackward.apply(x).sum().backward()
    assert np.isnan(x.grad.data).all()


async def test_anomaly_check_nan_can_be_switched_off() -> None:
    x = ag.randn(3, requires_grad=True)
    with ag.detect_anomaly(check_nan=False):
        assert ag.is_anomaly_enabled()
        assert not ag.is_anomaly_check_nan_enabled()
        await NanBackward.apply(x).sum().backward()
    assert not ag.is_anomaly_enabled()


class Fails(ag.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        raise ArithmeticError("bad backward")


async def test_anomaly_error_carries_forward_traceback() -> None:
    x = ag.randn(3, requires_grad=True)

    def build_graph() -> ag.Tensor:
        return Fails.apply(x).sum()

    with ag.detect_anomaly():
        y = build_graph()
    with pytest.raises(ArithmeticError) as info:
        await y.backward()
    notes = "\n".join(info.value.__notes__)
    assert "build_graph" in notes


async def test_anomaly_mode_is_per_task() -> None:
    entered = asyncio.Event()
    done = asyncio.Event()

    async def enables() -> None:
        with ag.detect_anomaly():
            entered.set()
            await done.wait()

    async def observes() -> bool:
        await entered.wait()
        result = ag.is_anomaly_enabled()
        done.set()
        return result

    _, seen = await asyncio.gather(enables(), observes())
    assert seen is False


async def test_checkpoint_without_grad_inputs_warns() -> None:
    w = ag.randn(2, 2, requires_grad=True)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        out = ag.checkpoint(lambda t: t @ w, ag.randn(2, 2))
    assert not out.requires_grad


async def test_anomaly_parent_chain_in_double_backward() -> None:
    x = ag.randn(3, dtype="float64", requires_grad=True)
    with ag.detect_anomaly():
        y = (x**3).sum()
        (g,) = await ag.grad(y, x, create_graph=True)
        parent = g.grad_fn.metadata.get("parent_")
    assert parent is not None
    assert parent.name() == "PowBackward0"
