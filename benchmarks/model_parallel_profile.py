"""Where the model-parallel step's time goes: phases, CPU, loop iterations, tasks (issue #15).

Runs the step of ``benchmarks/model_parallel.py`` (``AioStepper``: the example's model, data
and distributed optimizer) on rank 0 and reports, over ``--steps`` steps after ``--warmup``:
the step's median and minimum, the median of each phase (first layer, forward RPC, loss,
distributed backward, optimizer step, context release) with rank 0's loop-thread CPU and
loop iterations in it (means), and per step and per worker the CPU time of the process (all
threads, and by thread: the event loop's, the engine's executors, gRPC's poller, the other
Python threads, and the native ones: gRPC core's, BLAS's), the event-loop iterations, the
tasks created, the page faults and the context switches.
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
import threading
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
COUNTERS = ["cpu", "iterations", "tasks", "minor_faults", "context_switches"]


def _thread_group(name: str) -> str:
    if name == "MainThread":
        return "loop"
    if name.startswith("aioautograd-cpu"):
        return "engine"
    if "_poll_wrapper" in name:
        return "grpc_poller"
    return "other_python"


def _threads_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads so far, by group (``/proc``'s schedstat: ns);
    threads that Python does not know (gRPC core's, BLAS's) are ``native``."""
    groups = {thread.native_id: _thread_group(thread.name) for thread in threading.enumerate()}
    cpu: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as stat:
                seconds = int(stat.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
        group = groups.get(int(tid), "native")
        cpu[group] = cpu.get(group, 0.0) + seconds
    return cpu


def _process_counters() -> list[Any]:
    # Read on the loop's thread: process CPU, loop iterations, tasks, minor page faults
    # (/proc/self/stat field 10), context switches of all threads, CPU by thread group.
    with open("/proc/self/stat") as stat:
        minor_faults = int(stat.read().rsplit(")", 1)[1].split()[7])
    switches = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as status:
                for line in status:  # voluntary_ and nonvoluntary_ctxt_switches
                    if "ctxt_switches:" in line:
                        switches += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return [
        time.process_time(),
        COUNTS["iterations"],
        COUNTS["tasks"],
        minor_faults,
        switches,
        _threads_cpu(),
    ]


@rpc.register
async def counters() -> list[Any]:
    """This worker's counters so far (see ``_process_counters``)."""
    return _process_counters()


def _mark(marks: list[tuple[float, float, int]]) -> None:
    marks.append((time.perf_counter(), time.thread_time(), COUNTS["iterations"]))


async def _timed_step(stepper: AioStepper) -> list[tuple[float, float, int]]:
    marks: list[tuple[float, float, int]] = []
    _mark(marks)
    async with dist_autograd.context() as context_id:
        hidden = stepper.first(stepper.x)
        _mark(marks)
        logits = await rpc.rpc_async("worker1", example.stage_forward, args=(hidden,))
        _mark(marks)
        loss = F.cross_entropy(logits, stepper.y)
        _mark(marks)
        await dist_autograd.backward(context_id, [loss])
        _mark(marks)
        await stepper.optimizer.step(context_id)
        _mark(marks)
    _mark(marks)
    return marks


async def _drive(steps: int, warmup: int, backend: str) -> dict[str, Any]:
    stepper = AioStepper()
    await stepper.setup()
    for _ in range(warmup):
        await stepper.step()
    before = _process_counters()
    peer_before = await rpc.rpc_async("worker1", counters)
    marks = [await _timed_step(stepper) for _ in range(steps)]
    after = _process_counters()
    peer_after = await rpc.rpc_async("worker1", counters)
    table = np.array(marks)  # steps x marks x (wall, loop-thread CPU, loop iterations)
    totals = table[:, -1, 0] - table[:, 0, 0]
    phases = np.diff(table, axis=1)
    per_step = _per_step(before, after, steps)
    peer = _per_step(peer_before, peer_after, steps)
    one_process = backend == "local"  # both workers share the process, its loop and CPU
    return {
        "backend": backend,
        "steps": steps,
        "step_median_ms": round(float(np.median(totals)) * 1e3, 3),
        "step_min_ms": round(float(totals.min()) * 1e3, 3),
        "phase_median_us": dict(
            zip(PHASES, np.round(np.median(phases[:, :, 0], axis=0) * 1e6).tolist(), strict=True)
        ),
        # Rank 0's event-loop thread in each phase: CPU (mean) and loop iterations (mean).
        "phase_loop_cpu_us": dict(
            zip(PHASES, np.round(np.mean(phases[:, :, 1], axis=0) * 1e6).tolist(), strict=True)
        ),
        "phase_loop_iterations": dict(
            zip(PHASES, np.round(np.mean(phases[:, :, 2], axis=0), 2).tolist(), strict=True)
        ),
        # Per step: CPU (all threads), loop iterations, tasks; by process.
        "per_step": (
            {"process": per_step} if one_process else {"worker0": per_step, "worker1": peer}
        ),
        "load_average": os.getloadavg(),
    }


def _per_step(before: list[Any], after: list[Any], steps: int) -> dict[str, Any]:
    """Per step: CPU (all threads, ms), loop iterations, tasks, page faults, context
    switches, and the CPU of each group of threads (ms)."""
    values = {
        name: (b - a) / steps for name, a, b in zip(COUNTERS, before[:-1], after[:-1], strict=True)
    }
    threads_before, threads_after = before[-1], after[-1]
    return {
        "cpu_ms": round(values["cpu"] * 1e3, 3),
        "loop_iterations": round(values["iterations"], 2),
        "tasks": round(values["tasks"], 2),
        "minor_faults": round(values["minor_faults"], 1),
        "context_switches": round(values["context_switches"], 1),
        "threads_cpu_ms": {
            group: round((seconds - threads_before.get(group, 0.0)) / steps * 1e3, 3)
            for group, seconds in sorted(threads_after.items())
        },
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
