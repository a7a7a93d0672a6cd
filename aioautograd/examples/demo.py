"""A single-model example: train an MLP on two interleaved spirals with ``await
loss.backward()`` while a heartbeat task shows that the event loop keeps serving.

Runs on a plain install (NumPy only; uvloop when installed):
``python -m aioautograd.examples.demo [--steps N]``. The flagship example, ``make demo``, is
:mod:`aioautograd.examples.concurrent_training`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time

import numpy as np

import aioautograd as ag
from aioautograd.examples.data import make_spirals
from aioautograd.nn import functional as F


def init_mlp(sizes: list[int], seed: int) -> list[ag.Tensor]:
    rng = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        bound = 1 / np.sqrt(fan_in)
        params.append(
            ag.tensor(
                rng.uniform(-bound, bound, (fan_out, fan_in)), dtype="float32", requires_grad=True
            )
        )
        params.append(
            ag.tensor(rng.uniform(-bound, bound, fan_out), dtype="float32", requires_grad=True)
        )
    return params


def forward(params: list[ag.Tensor], x: ag.Tensor) -> ag.Tensor:
    h = x
    for i in range(0, len(params) - 2, 2):
        h = F.relu(F.linear(h, params[i], params[i + 1]))
    return F.linear(h, params[-2], params[-1])


@ag.no_grad()
def sgd_step(params: list[ag.Tensor], velocity: list[ag.Tensor], lr: float) -> None:
    for p, v in zip(params, velocity, strict=True):
        assert p.grad is not None
        v.mul_(0.9).add_(p.grad)
        p.sub_(v, alpha=lr)
        p.grad = None


async def heartbeat(stop: asyncio.Event, gaps: list[float], period: float = 0.001) -> None:
    """Tick every millisecond and record how late each tick was."""
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(period)
        now = time.perf_counter()
        gaps.append(now - last - period)
        last = now


async def train(steps: int) -> float:
    x, y = make_spirals(300, 3, seed=0)
    params = init_mlp([2, 128, 128, 3], seed=1)
    velocity = [ag.zeros_like(p) for p in params]
    stop, gaps = asyncio.Event(), list[float]()
    beat = asyncio.create_task(heartbeat(stop, gaps))
    print(f"training a 2-128-128-3 MLP on {len(x)} spiral points, {steps} steps")
    start = time.perf_counter()
    try:
        for step in range(steps + 1):
            loss = F.cross_entropy(forward(params, x), y)
            await loss.backward()
            sgd_step(params, velocity, lr=0.1)
            if step % (steps // 10 or 1) == 0:
                with ag.no_grad():
                    accuracy = (forward(params, x).argmax(1) == y).numpy().mean()
                print(f"step {step:4d}  loss {loss.item():.4f}  accuracy {accuracy:6.1%}")
    finally:
        stop.set()
        await beat
    elapsed = time.perf_counter() - start
    print(
        f"{steps} steps in {elapsed:.2f} s. Meanwhile a 1 ms heartbeat task on the same event "
        f"loop ticked {len(gaps)} times (median delay {np.median(gaps) * 1e3:.2f} ms, longest "
        f"{max(gaps) * 1e3:.1f} ms): backward passes ran on executor threads, while the "
        "forward passes of this demo ran in the training coroutine itself."
    )
    return float(loss.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    try:
        import uvloop
    except ImportError:
        asyncio.run(train(args.steps))
    else:
        uvloop.run(train(args.steps))


if __name__ == "__main__":
    main()
