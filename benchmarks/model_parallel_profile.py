"""Where the model-parallel step's time goes: phases, CPU, loop iterations, tasks (issue #15).

Runs the step of ``benchmarks/model_parallel.py`` (``AioStepper``: the example's model, data
and distributed optimizer) on rank 0 and reports, over ``--steps`` steps after ``--warmup``:
the step's median and minimum, the median of each phase (first layer, forward RPC, loss,
distributed backward, optimizer step, context release), and per step and per worker the CPU
time of the process (all threads), the event-loop iterations and the tasks created.
A diagnostic, not a comparison against PyTorch (``model_parallel.py`` does that)::

    PYTHONPATH=. python benchmarks/model_parallel_profile.py                # local backend
    PYTHONPATH=. python -m aioautograd.distributed.run --nproc 2 \\
        benchmarks/model_parallel_profile.py                               # grpc, 2 processes

Prints one JSON line (rank 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import numpy as np  # noqa: E402

from aioautograd.distributed import autograd as dist_autograd  # noqa: E402
from aioautograd.distributed import rpc  # noqa: E402
from aioautograd.nn import functional as F  # noqa: E402
from benchmarks.loop_counters import COUNTS, count_loop  # noqa: E402
from benchmarks.model_parallel_workers import AioStepper, example  # noqa: E402

PHASES = ["first_layer", "forward_rpc", "loss", "backward", "optimizer", "release"]


@rpc.register
async def counters() -> list[float]:
    """This worker's CPU seconds and loop counters so far."""
    return [time.process_time(), COUNTS["iterations"], COUNTS["tasks"]]


async def _timed_step(stepper: AioStepper) -> list[float]:
    marks = [time.perf_counter()]
    async with dist_autograd.context() as context_id:
        hidden = stepper.first(stepper.x)
        marks.append(time.perf_counter())
        logits = await rpc.rpc_async("worker1", example.stage_forward, args=(hidden,))
        marks.append(time.perf_counter())
        loss = F.cross_entropy(logits, stepper.y)
        marks.append(time.perf_counter())
        await dist_autograd.backward(context_id, [loss])
        marks.append(time.perf_counter())
        await stepper.optimizer.step(context_id)
        marks.append(time.perf_counter())
    marks.append(time.perf_counter())
    return marks


async def _drive(steps: int, warmup: int, backend: str) -> dict[str, Any]:
    stepper = AioStepper()
    await stepper.setup()
    for _ in range(warmup):
        await stepper.step()
    before = [time.process_time(), COUNTS["iterations"], COUNTS["tasks"]]
    peer_before = await rpc.rpc_async("worker1", counters)
    marks = [await _timed_step(stepper) for _ in range(steps)]
    after = [time.process_time(), COUNTS["iterations"], COUNTS["tasks"]]
    peer_after = await rpc.rpc_async("worker1", counters)
    table = np.array(marks)
    totals = table[:, -1] - table[:, 0]
    per_step = [(b - a) / steps for a, b in zip(before, after, strict=True)]
    peer = [(b - a) / steps for a, b in zip(peer_before, peer_after, strict=True)]
    one_process = backend == "local"  # both workers share the process, its loop and CPU
    return {
        "backend": backend,
        "steps": steps,
        "step_median_ms": round(float(np.median(totals)) * 1e3, 3),
        "step_min_ms": round(float(totals.min()) * 1e3, 3),
        "phase_median_us": dict(
            zip(
                PHASES,
                np.round(np.median(np.diff(table, axis=1), axis=0) * 1e6).tolist(),
                strict=True,
            )
        ),
        # Per step: CPU (all threads), loop iterations, tasks; by process.
        "per_step": (
            {"process": _per_step_dict(per_step)}
            if one_process
            else {"worker0": _per_step_dict(per_step), "worker1": _per_step_dict(peer)}
        ),
        "load_average": os.getloadavg(),
    }


def _per_step_dict(values: list[float]) -> dict[str, float]:
    cpu, iterations, tasks = values
    return {
        "cpu_ms": round(cpu * 1e3, 3),
        "loop_iterations": round(iterations, 2),
        "tasks": round(tasks, 2),
    }


async def _worker(rank: int, backend: str, args: argparse.Namespace) -> None:
    if rank == 0 or backend != "local":
        count_loop(asyncio.get_running_loop())
    await rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, backend=backend)
    try:
        if rank == 0:
            print(json.dumps(await _drive(args.steps, args.warmup, backend)), flush=True)
    finally:
        await rpc.shutdown()


async def _main(args: argparse.Namespace) -> None:
    if "RANK" in os.environ:  # started by the launcher: one worker per process
        backend = os.environ.get("AIOAUTOGRAD_RPC_BACKEND") or "grpc"
        await _worker(int(os.environ["RANK"]), backend, args)
    else:
        await asyncio.gather(*(_worker(rank, "local", args) for rank in range(2)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=30)
    asyncio.run(_main(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
