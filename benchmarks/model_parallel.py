"""Two-worker model-parallel training step: ``grpc`` (two processes on loopback, started by
the launcher) vs ``local`` (both workers in one process), SPEC §8.

One step = a distributed autograd context, the forward across the split (one RPC), the
distributed backward (gradients sent back across the split) and a ``DistributedOptimizer``
step on both owners (the model of ``aioautograd.examples.model_parallel``: 2-64 on worker 0,
64-64-3 on worker 1, 600 points). Prints one JSON line per backend and a markdown table.

    python benchmarks/model_parallel.py [--steps N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _summary(backend: str, step_s: list[float], warmup: int) -> dict[str, Any]:
    timed = step_s[warmup:]
    return {
        "name": "model_parallel_step",
        "impl": backend,
        "median_s": statistics.median(timed),
        "min_s": min(timed),
        "max_s": max(timed),
        "repeats": len(timed),
        "warmup": warmup,
    }


def run_local(steps: int) -> list[float]:
    from aioautograd.examples import model_parallel

    captured: list[float] = []

    async def main() -> None:
        results = await asyncio.gather(
            model_parallel.worker(0, 2, "local", steps, report_json=False),
            model_parallel.worker(1, 2, "local", steps, report_json=False),
        )
        assert results[0] is not None

    original = model_parallel.train_distributed

    async def timed(steps_: int, seed: int) -> tuple[list[float], list[float]]:
        losses, durations = await original(steps_, seed)
        captured.extend(durations)
        return losses, durations

    model_parallel.train_distributed = timed  # type: ignore[assignment]
    try:
        asyncio.run(main())
    finally:
        model_parallel.train_distributed = original  # type: ignore[assignment]
    return captured


def run_grpc(steps: int) -> list[float]:
    command = [
        sys.executable,
        "-m",
        "aioautograd.distributed.run",
        "--nproc",
        "2",
        "-m",
        "aioautograd.examples.model_parallel",
        "--backend",
        "grpc",
        "--steps",
        str(steps),
        "--json",
    ]
    output = subprocess.run(
        command, capture_output=True, text=True, timeout=600, cwd=ROOT, check=True
    ).stdout
    for line in output.splitlines():
        text = line.split("] ", 1)[-1]
        if text.startswith("{"):
            return list(json.loads(text)["step_s"])
    raise RuntimeError(f"no JSON line in the launcher's output:\n{output}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    rows = {
        "local": _summary("local", run_local(args.steps), args.warmup),
        "grpc": _summary("grpc", run_grpc(args.steps), args.warmup),
    }
    for row in rows.values():
        print(json.dumps(row))
    local, grpc = rows["local"]["median_s"], rows["grpc"]["median_s"]
    print()
    print("| figure | local (median / min) | grpc (median / min) | grpc / local |")
    print("|---|---|---|---|")
    print(
        f"| two-worker model-parallel step | {local * 1e3:.2f} / "
        f"{rows['local']['min_s'] * 1e3:.2f} ms | {grpc * 1e3:.2f} / "
        f"{rows['grpc']['min_s'] * 1e3:.2f} ms | {grpc / local:.2f}x |"
    )


if __name__ == "__main__":
    main()
