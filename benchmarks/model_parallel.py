"""Two-worker model-parallel training step (spec §8): aioautograd over ``grpc`` (two
processes on loopback, started by the launcher) and ``local`` (both workers in one process)
vs ``torch.distributed.rpc`` + ``torch.distributed.autograd`` (two processes, TensorPipe
with its default transports, and ``torch-uv``: with its TCP transport only).

One step = a distributed autograd context, the forward across the split (one RPC), the
distributed backward (gradients sent back across the split) and a distributed optimizer
step on both owners (the model of ``aioautograd.examples.model_parallel``: 2-64 on worker 0,
64-64-3 on worker 1, 600 points, the same initial weights and data for all). This is
the ``model_parallel`` workload of ``benchmarks/run.py`` (``benchmarks/distributed.py``) with
its own step counts. Prints one JSON line per implementation, a summary line (ratios, loss
differences) and a markdown table.

    python benchmarks/model_parallel.py [--steps N] [--warmup W] [--compare-steps K]
                                        [--threads T] [--impl NAME,...]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))  # so `python benchmarks/model_parallel.py` works


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per implementation")
    parser.add_argument("--warmup", type=int, default=20, help="first steps not timed")
    parser.add_argument(
        "--compare-steps",
        type=int,
        default=20,
        help="first steps whose losses are compared across implementations",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="BLAS and torch intra-op threads of the worker processes (default: as is)",
    )
    parser.add_argument(
        "--impl",
        action="append",
        metavar="NAME",
        help="aioautograd (grpc), aioautograd-uvloop, aioautograd-awake, aioautograd-local, torch, "
        "torch-uv (repeatable, or "
        "comma-separated)",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        parser.error("need 0 <= --warmup < --steps")
    return args


async def measure(
    steps: int, warmup: int, compare_steps: int, impls: set[str] | None
) -> str | None:
    """Run the ``model_parallel`` workload with ``steps`` steps per implementation, the first
    ``warmup`` untimed, comparing the losses of the first ``compare_steps``; prints its JSON
    lines and returns its table."""
    from benchmarks import harness
    from benchmarks.workloads import REGISTRY

    workload = REGISTRY["model_parallel"]
    params = {**workload.sizes["full"], "compare_steps": compare_steps}
    custom = dataclasses.replace(
        workload, sizes={"custom": params}, repeats={"custom": (warmup, steps - warmup)}
    )
    least_warmup_s, harness.MIN_WARMUP_S = harness.MIN_WARMUP_S, 0.0  # exactly `warmup` steps
    try:
        _, table = await harness.run_workload(custom, "custom", impls)
    finally:
        harness.MIN_WARMUP_S = least_warmup_s
    return table


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.threads is not None:  # inherited by the worker processes
        for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[name] = str(args.threads)
    impls = {n for item in args.impl or [] for n in item.split(",") if n} or None
    table = asyncio.run(measure(args.steps, args.warmup, args.compare_steps, impls))
    if table is not None:
        print()
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
