"""What ran on the event loop during every late tick of `concurrent` natural training.

The 1 ms heartbeat's p99 pools ~90-120 ticks a run over the harness's 8 runs, so it is about
each run's second-longest delay. This script runs the harness's natural concurrent case
(`concurrency._AioTraining`, 4 models 784-512-512-10) with probes on the loop: every
callback the loop runs (`Handle._run`: start, duration, loop iteration, which training
coroutine and which part of its step: `fwd` forward and loss, `bwdstart` the backward's
start, `resumed` back from `await loss.backward()`, `stepped` after `optimizer.step()`),
every backward completion (when a worker signalled it, when the loop resolved it), and the
cyclic GC's passes. For each tick later than `--threshold` ms it prints the callbacks of
the late window; then per-turn figures (wall and loop-thread CPU time of the step and the
forward pass, the forward's matrix products on the loop) over all runs.

    python benchmarks/loop_trace.py --runs 8 --gate
    python benchmarks/loop_trace.py --runs 8 --gate --threshold 12 --all-callbacks

`--gate` waits before each run until the machine looks idle (see `budget_ab.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import asyncio.base_events
import asyncio.events
import bisect
import gc
import itertools
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from aioautograd.devices.cpu_budget import CpuBudget
from aioautograd.engine.graph_task import GraphTask
from aioautograd.nn import functional as F
from benchmarks import concurrency
from benchmarks.budget_ab import wait_until_idle

callbacks: list[tuple[float, float, str]] = []  # (start, end, name) of each loop callback
iterations: list[float] = []  # start of each loop iteration
marks: list[tuple[float, int, float, str]] = []  # (time, model, loop CPU time, phase)
products: list[tuple[float, float, float, float]] = []  # loop products: wall and CPU spans
completions: list[tuple[float, float]] = []  # (signalled on a worker, resolved on the loop)
collections: list[tuple[float, float, int]] = []
tracing = False
loop_thread = threading.get_ident()


def _install_probes() -> None:
    run_handle = asyncio.events.Handle._run
    run_once = asyncio.base_events.BaseEventLoop._run_once  # type: ignore[attr-defined]
    matmul = CpuBudget.matmul
    all_done, resolve = GraphTask.all_tasks_done, GraphTask._resolve_done
    signalled: dict[int, float] = {}
    gc_started: dict[int, float] = {}

    def probe_handle(self: Any) -> None:
        if not tracing:
            return run_handle(self)
        start = time.perf_counter()
        try:
            return run_handle(self)
        finally:
            callback = self._callback
            owner = getattr(callback, "__self__", None)
            name = getattr(callback, "__qualname__", None) or repr(callback)
            if isinstance(owner, asyncio.Task):
                name = "step:" + owner.get_coro().__qualname__
            callbacks.append((start, time.perf_counter(), name))

    def probe_iteration(self: Any) -> None:
        if tracing:
            iterations.append(time.perf_counter())
        return run_once(self)

    def probe_matmul(self: CpuBudget, a: Any, b: Any) -> Any:
        if not tracing or threading.get_ident() != loop_thread:
            return matmul(self, a, b)
        start, cpu = time.perf_counter(), time.thread_time()
        out = matmul(self, a, b)
        products.append((start, time.perf_counter(), cpu, time.thread_time()))
        return out

    def probe_all_done(self: GraphTask) -> None:
        signalled[id(self)] = time.perf_counter()
        all_done(self)

    def probe_resolve(self: GraphTask) -> None:
        completions.append((signalled.pop(id(self), 0.0), time.perf_counter()))
        resolve(self)

    def probe_gc(phase: str, info: dict[str, Any]) -> None:
        if tracing and phase == "start":
            gc_started[threading.get_ident()] = time.perf_counter()
        elif tracing and threading.get_ident() in gc_started:
            start = gc_started.pop(threading.get_ident())
            collections.append((start, time.perf_counter(), info["generation"]))

    asyncio.events.Handle._run = probe_handle  # type: ignore[method-assign]
    asyncio.base_events.BaseEventLoop._run_once = probe_iteration  # type: ignore[attr-defined]
    CpuBudget.matmul = probe_matmul  # type: ignore[method-assign]
    GraphTask.all_tasks_done = probe_all_done  # type: ignore[method-assign]
    GraphTask._resolve_done = probe_resolve  # type: ignore[method-assign]
    gc.callbacks.append(probe_gc)


class _Traced(concurrency._AioTraining):
    """The harness's natural training loop, marking each part of a step."""

    async def _train(self, index: int) -> float:
        model, optimizer = self.models[index], self.optimizers[index]
        inputs, targets = self.batches[index]
        value = 0.0
        for step in range(self.steps):
            marks.append((time.perf_counter(), index, time.thread_time(), f"fwd{step}"))
            loss = F.cross_entropy(model(inputs), targets)
            optimizer.zero_grad()
            marks.append((time.perf_counter(), index, time.thread_time(), f"bwdstart{step}"))
            await loss.backward()
            marks.append((time.perf_counter(), index, time.thread_time(), f"resumed{step}"))
            optimizer.step()
            value = float(loss.item())
            marks.append((time.perf_counter(), index, time.thread_time(), f"stepped{step}"))
        return value


def _late_windows(threshold_ms: float, all_callbacks: bool, run: int) -> None:
    wakes = [start for start, _, name in callbacks if name == "step:Heartbeat._beat"]
    for previous, woke in itertools.pairwise(wakes):
        late_ms = (woke - previous - 0.001) * 1e3
        if late_ms < threshold_ms:
            continue
        inside = [c for c in callbacks if c[1] > previous and c[0] <= woke]
        busy = sum(min(woke, end) - max(previous, start) for start, end, _ in inside)
        print(
            f"run {run}: tick {1e3 * (previous - marks[0][0]):6.1f} ms into the run, "
            f"{late_ms:5.1f} ms late (loop callbacks {1e3 * busy:.1f} ms of the "
            f"{1e3 * (woke - previous):.1f} ms since the previous tick)"
        )
        for start, end, name in inside:
            phases = [f"m{m}:{p}" for t, m, _, p in marks if start <= t <= end]
            if (end - start) < 3e-4 and not phases and not all_callbacks:
                continue
            passes = [f"gc{g}:{1e3 * (e - s):.1f}ms" for s, e, g in collections if s < end < e]
            print(
                f"    iteration {bisect.bisect_right(iterations, start)} "
                f"+{1e3 * (start - previous):5.1f} ms, {1e3 * (end - start):4.1f} ms "
                f"{name.rsplit('.', 1)[-1][:24]} {' '.join(phases + passes)}"
            )
        near = [
            f"signalled +{1e3 * (s - previous):.1f} resolved +{1e3 * (r - previous):.1f}"
            for s, r in completions
            if previous - 0.003 < r < woke
        ]
        print(f"    completions: {', '.join(near) or 'none'}")


def _turn_figures(figures: dict[str, list[float]]) -> None:
    by_model: dict[int, list[tuple[float, float, str]]] = {}
    for t, model, cpu, phase in marks:
        by_model.setdefault(model, []).append((t, cpu, phase))
    for events in by_model.values():
        for (t0, c0, p0), (t1, c1, _) in itertools.pairwise(events):
            if p0.startswith("resumed"):
                figures["optimizer step, wall"].append(t1 - t0)
                figures["optimizer step, loop CPU"].append(c1 - c0)
            elif p0.startswith("fwd"):
                inside = [p for p in products if t0 <= p[0] <= t1]
                figures["forward, wall"].append(t1 - t0)
                figures["forward, loop CPU"].append(c1 - c0)
                figures["forward's products, wall"].append(sum(e - s for s, e, _, _ in inside))
                figures["forward's products, loop CPU"].append(
                    sum(ce - cs for _, _, cs, ce in inside)
                )
    for start, end, name in callbacks:
        if name == "step:_Traced._train" and any(
            start <= t <= end and p.startswith("resumed") for t, _, _, p in marks
        ):
            figures["turn (one callback)"].append(end - start)


def main() -> None:
    global tracing
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--threshold", type=float, default=8.0, help="ms")
    parser.add_argument("--gate", action="store_true")
    parser.add_argument("--all-callbacks", action="store_true")
    args = parser.parse_args()
    _install_probes()
    case = _Traced(concurrency._TRAINING_SIZES["full"], True, False)
    loop = asyncio.new_event_loop()
    case.prepare()
    loop.run_until_complete(case.run())  # warm-up
    runs: list[list[float]] = []
    figures: dict[str, list[float]] = {
        name: []
        for name in (
            "optimizer step, wall",
            "optimizer step, loop CPU",
            "forward, wall",
            "forward, loop CPU",
            "forward's products, wall",
            "forward's products, loop CPU",
            "turn (one callback)",
        )
    }
    for run in range(args.runs):
        for probe in (callbacks, iterations, marks, products, completions, collections):
            probe.clear()
        case.begin_timed()
        case.prepare()
        if args.gate:
            wait_until_idle()
        tracing = True
        loop.run_until_complete(case.run())
        tracing = False
        runs.append(list(case.delays_ms))
        _late_windows(args.threshold, args.all_callbacks, run)
        _turn_figures(figures)
        top = ", ".join(f"{d:.1f}" for d in sorted(case.delays_ms)[::-1][:4])
        print(
            f"run {run}: {1e3 * case.timed_s:.0f} ms, {len(case.delays_ms)} ticks, longest "
            f"delays {top} ms, GC passes {len(collections)}"
        )
    pooled = np.asarray([d for run in runs for d in run])
    second = statistics.median(sorted(run)[-2] for run in runs)
    print(
        f"ticks {len(pooled)}: p99 {np.percentile(pooled, 99):.1f} ms, max {pooled.max():.1f} "
        f"ms, median of each run's second-longest {second:.1f} ms"
    )
    for name, values in figures.items():
        if values:
            ms = 1e3 * np.asarray(values)
            print(
                f"{name:30s} n {len(ms):4d}  median {np.median(ms):5.2f} ms  "
                f"p90 {np.percentile(ms, 90):5.2f}  max {ms.max():5.2f}"
            )


if __name__ == "__main__":
    main()
