"""Where the host time of a ``gpu_mlp`` step goes (needs CuPy, a GPU and a CUDA build of torch).

Prints the step times of aioautograd and torch (three alternations of 200 steps each), the
host time of aioautograd's step split into forward, ``await backward()``, the SGD update and
``loss.item()``, and the CUDA kernels per step of both, counted by ``torch.profiler`` (CUPTI
sees every kernel of the process, CuPy's too). With ``--cprofile N``, the N functions of most
own time over 200 more steps.

Usage::

    PYTHONPATH=. python benchmarks/gpu_profile.py [--cprofile 40]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import time
from typing import Any

import aioautograd as ag
from benchmarks.workloads import LEARNING_RATE, MLP_SIZES, _AioMlp, _TorchMlp


async def _split(case: _AioMlp, steps: int = 200) -> dict[str, float]:
    parts = dict.fromkeys(("forward", "backward", "update", "item"), 0.0)
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = case.forward_loss()
        t1 = time.perf_counter()
        await loss.backward()
        t2 = time.perf_counter()
        with ag.no_grad():
            for p in case.params:
                p.sub_(p.grad, alpha=LEARNING_RATE)
                p.grad = None
        t3 = time.perf_counter()
        float(loss.item())
        t4 = time.perf_counter()
        for key, value in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            parts[key] += value / steps
    return parts


def _count(torch: Any, prof: Any, steps: int) -> tuple[float, dict[str, int]]:
    """Kernels per step, and the count of each kernel name, of a ``torch.profiler`` run."""
    counts: dict[str, int] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            counts[event.name[:80]] = counts.get(event.name[:80], 0) + 1
    return sum(counts.values()) / steps, counts


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cprofile", type=int, default=0, metavar="N")
    args = parser.parse_args()
    import torch

    params = MLP_SIZES["full"]
    case, reference = _AioMlp(params, "cuda:0"), _TorchMlp(params, "cuda")
    for _ in range(20):
        await case.run()
        reference.run()
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(200):
            await case.run()
        aio = (time.perf_counter() - start) / 200
        start = time.perf_counter()
        for _ in range(200):
            reference.run()
        print(
            f"step: aioautograd {aio * 1e3:.2f} ms, torch {(time.perf_counter() - start) * 5:.2f} ms"
        )
    split = await _split(case)
    print("aioautograd host time:", ", ".join(f"{k} {v * 1e6:.0f} µs" for k, v in split.items()))

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            await case.run()
        torch.cuda.synchronize()
    per_step, counts = _count(torch, prof, 10)
    print(f"CUDA kernels per step: aioautograd {per_step:.1f}")
    for name, count in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"  {count / 10:5.1f}  {name}")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            reference.run()
        torch.cuda.synchronize()
    print(f"CUDA kernels per step: torch {_count(torch, prof, 10)[0]:.1f}")
    if args.cprofile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(200):
            await case.run()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.cprofile)


if __name__ == "__main__":
    asyncio.run(main())
