"""Where the two cores' time goes in `concurrent` training: per-thread states, swept.

Runs the harness's training case (`concurrency._AioTraining`, 4 models 784-512-512-10 b256 by
default) with probes that put every thread of the process in one state at every instant:

- `blas`: inside a matrix product of the CPU budget (a whole product, a chunk of a split or
  paired one, a slice);
- `py`: running Python (a worker between its nodes' products, the loop's thread inside a
  callback): these threads share one GIL;
- `park`: a counted thread waiting for a core (``CpuBudget._wait_for_room``: the loop's hold,
  or the budget spent);
- `join`: a thread waiting for the other chunks of its split or paired product;
- `idle`: nothing to do (a worker waiting for a task, a helper for a chunk, the loop's
  thread in ``select``).

The sweep then splits the run's 2 x wall time ("core time") into: BLAS on a core, Python
holding the GIL, and the cores left without work, for each of the reasons above (a thread
parked while a core has nothing to run, the GIL, nobody has work); it also gives each
thread's CPU and run-queue wait from ``/proc/self/task/<tid>/schedstat``, and the CPU other
processes took meanwhile. With ``--phases`` it prints, per state of the loop (a forward pass,
an optimizer step, idle), what the workers did meanwhile.

    python benchmarks/core_trace.py --schedule conc,seq --runs 4 --gate

Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import asyncio
import asyncio.base_events
import asyncio.events
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

import aioautograd.devices.cpu_budget as cpu_budget_module
from aioautograd.devices.cpu_budget import CpuBudget, _SplitProduct
from aioautograd.engine.executor import Executor
from aioautograd.nn import functional as F
from benchmarks import concurrency
from benchmarks.budget_ab import _busy_s, _own_cpu_s, wait_until_idle

events: list[tuple[float, int, str]] = []  # (time, native thread id, state entered)
phases: list[tuple[float, int, str]] = []  # (time, model, phase of the loop) natural code
tracing = False
detail = False  # name each product's shapes in its state (``dump``)


class _Stack(threading.local):
    def __init__(self) -> None:
        self.states: list[str] = []


_stack = _Stack()


def _push(state: str) -> None:
    _stack.states.append(state)
    if tracing:
        events.append((time.perf_counter(), threading.get_native_id(), state))


def _pop() -> None:
    states = _stack.states
    states.pop()
    if tracing:
        events.append((time.perf_counter(), threading.get_native_id(), states[-1]))


def _install_probes(loop_tid: int) -> None:
    real_np = np

    class _NumpyProbe:
        def __getattr__(self, name: str) -> Any:
            return getattr(real_np, name)

        @staticmethod
        def matmul(*args: Any, **kwargs: Any) -> Any:
            _push("blas" if not detail else f"blas {args[0].shape}@{args[1].shape}")
            try:
                return real_np.matmul(*args, **kwargs)
            finally:
                _pop()

    cpu_budget_module.np = _NumpyProbe()  # type: ignore[assignment]

    def wrap(owner: Any, name: str, state: str, base: str | None = None) -> None:
        original = getattr(owner, name)

        def probe(*args: Any, **kwargs: Any) -> Any:
            if base is not None and not _stack.states:
                _stack.states.append(base)
            _push(state)
            try:
                return original(*args, **kwargs)
            finally:
                _pop()

        setattr(owner, name, probe)

    wrap(CpuBudget, "_wait_for_room", "park", base="py")
    wrap(_SplitProduct, "wait", "join", base="py")
    wrap(Executor, "_next_task", "idle", base="py")

    run_handle = asyncio.events.Handle._run

    def probe_handle(self: Any) -> Any:
        if threading.get_native_id() != loop_tid:
            return run_handle(self)
        if not _stack.states:
            _stack.states.append("idle")
        _push("py")
        try:
            return run_handle(self)
        finally:
            _pop()

    asyncio.events.Handle._run = probe_handle  # type: ignore[method-assign]

    helper_main = cpu_budget_module._Helper._main

    def probe_helper(self: Any) -> Any:
        _stack.states.append("idle")
        return helper_main(self)

    cpu_budget_module._Helper._main = probe_helper  # type: ignore[method-assign]
    # Chunks on a helper: state "blas" through the matmul probe; between them "idle" (its
    # inbox), so a helper's Python between chunks counts as idle (microseconds).


class _Traced(concurrency._AioTraining):
    """The harness's training loop, marking the loop's phases (natural code)."""

    async def _train(self, index: int) -> float:
        if self.offload:
            return await super()._train(index)
        model, optimizer = self.models[index], self.optimizers[index]
        inputs, targets = self.batches[index]
        value = 0.0
        for _ in range(self.steps):
            phases.append((time.perf_counter(), index, "forward"))
            loss = F.cross_entropy(model(inputs), targets)
            optimizer.zero_grad()
            phases.append((time.perf_counter(), index, "await"))
            await loss.backward()
            phases.append((time.perf_counter(), index, "step"))
            optimizer.step()
            value = float(loss.item())
            phases.append((time.perf_counter(), index, "await"))
        return value


def _schedstat() -> dict[int, tuple[int, int, int]]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run_ns, wait_ns, slices = (int(v) for v in f.read().split())
        except OSError:
            continue
        out[int(tid)] = (run_ns, wait_ns, slices)
    return out


def _thread_names() -> dict[int, str]:
    names = {}
    for thread in threading.enumerate():
        if thread.native_id is not None:
            names[thread.native_id] = thread.name
    return names


def _kind(name: str, tid: int, loop_tid: int) -> str:
    if tid == loop_tid:
        return "loop"
    if name.startswith("aioautograd-intra-op"):
        return "helper"
    if name.startswith("aioautograd-cpu"):
        return "worker"
    return "other"


def _sweep(
    start: float, end: float, loop_tid: int, kinds: dict[int, str]
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Core time (2 x wall) split by what the threads did; and, per loop phase, the same."""
    cores = 2
    state: dict[int, str] = {}
    # A thread's state before its first event: "idle".
    for tid in kinds:
        state[tid] = "idle"
    timeline = sorted(events)
    marks = sorted((t, p) for t, _, p in phases)
    totals: dict[str, float] = defaultdict(float)
    by_phase: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    phase = "idle"
    mi = 0
    previous = start
    ei = 0

    def account(t0: float, t1: float) -> None:
        dt = t1 - t0
        if dt <= 0:
            return
        counts: dict[str, int] = defaultdict(int)
        for s in state.values():
            counts[s] += 1
        blas = min(sum(v for k, v in counts.items() if k.startswith("blas")), cores)
        py = min(counts["py"], 1, cores - blas)  # one GIL
        used = blas + py
        free = cores - used
        bucket = by_phase[phase]
        for key, value in (("blas", blas), ("python", py)):
            totals[key] += value * dt
            bucket[key] += value * dt
        if free > 0:
            if counts["park"]:
                why = f"free core, a thread parked (loop {state.get(loop_tid, 'idle')})"
            elif counts["py"] > py:
                why = "free core, a thread waits for the GIL"
            else:
                why = "free core, no work"
            totals[why] += free * dt
            bucket[why] += free * dt
        elif counts["park"]:
            totals["(parked while cores busy)"] += counts["park"] * dt
        bucket["wall"] += dt
        loop_state = state.get(loop_tid, "idle")
        totals[f"loop {loop_state}"] += dt

    while ei < len(timeline) and timeline[ei][0] < start:
        _, tid, s = timeline[ei]
        state[tid] = s
        ei += 1
    while mi < len(marks) and marks[mi][0] < start:
        phase = marks[mi][1]
        mi += 1
    while True:
        t_event = timeline[ei][0] if ei < len(timeline) else end
        t_mark = marks[mi][0] if mi < len(marks) else end
        t = min(t_event, t_mark, end)
        account(previous, t)
        previous = t
        if t >= end:
            break
        if t == t_event and ei < len(timeline):
            _, tid, s = timeline[ei]
            state[tid] = s
            ei += 1
        else:
            phase = marks[mi][1]
            mi += 1
    return totals, by_phase


def main() -> None:
    global tracing
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--schedule", default="conc,seq")
    parser.add_argument("--size", choices=("full", "mid"), default="full")
    parser.add_argument("--gate", action="store_true")
    parser.add_argument("--phases", action="store_true")
    parser.add_argument("--setting", action="append", default=[], help="CpuBudget attribute=value")
    args = parser.parse_args()
    loop_tid = threading.get_native_id()
    _install_probes(loop_tid)
    from aioautograd.devices.cpu_budget import cpu_budget

    budget = cpu_budget()
    for setting in args.setting:
        key, _, raw = setting.partition("=")
        setattr(budget, key, float(raw) if "." in raw else int(raw))
    sizes = concurrency._TRAINING_SIZES if args.size == "full" else concurrency._TRAINING_MID_SIZES
    params = sizes["full"]
    cases = {
        s: _Traced(params, s.startswith("conc"), s.endswith("-off"))
        for s in args.schedule.split(",")
    }
    loop = asyncio.new_event_loop()
    for case in cases.values():
        case.prepare()
        loop.run_until_complete(case.run())
    results: dict[str, list[dict[str, float]]] = defaultdict(list)
    phase_results: dict[str, list[dict[str, dict[str, float]]]] = defaultdict(list)
    for _ in range(args.runs):
        for name, case in cases.items():
            events.clear()
            phases.clear()
            case.begin_timed()
            case.prepare()
            if args.gate:
                wait_until_idle()
            counts0 = {
                c: getattr(budget, c)
                for c in ("split_products", "split_backoffs", "sliced_products", "paired_products")
            }
            before = _schedstat()
            own0, all0 = _own_cpu_s(), _busy_s()
            tracing = True
            loop.run_until_complete(case.run())
            tracing = False
            after = _schedstat()
            wall = case.timed_s
            start = phases[0][0] if phases else events[0][0]
            end = start + wall
            foreign = max(0.0, (_busy_s() - all0) - (_own_cpu_s() - own0))
            names = _thread_names()
            kinds = {tid: _kind(names.get(tid, ""), tid, loop_tid) for tid in after}
            totals, by_phase = _sweep(start, end, loop_tid, kinds)
            row: dict[str, float] = {"wall": wall, "foreign": foreign}
            for counter in (
                "split_products",
                "split_backoffs",
                "sliced_products",
                "paired_products",
            ):
                row[f"n {counter}"] = (getattr(budget, counter) - counts0[counter]) / 1e3
            for tid, (run_ns, wait_ns, slices) in after.items():
                run0, wait0, slices0 = before.get(tid, (0, 0, 0))
                kind = kinds[tid]
                row[f"cpu {kind}"] = row.get(f"cpu {kind}", 0.0) + (run_ns - run0) / 1e9
                row[f"runq {kind}"] = row.get(f"runq {kind}", 0.0) + (wait_ns - wait0) / 1e9
                row[f"n switches {kind}"] = (
                    row.get(f"n switches {kind}", 0.0) + (slices - slices0) / 1e3
                )
            row["idle cores"] = (
                2 * wall - sum(v for k, v in row.items() if k.startswith("cpu ")) - foreign
            )
            row.update(totals)
            results[name].append(row)
            phase_results[name].append(by_phase)
            print(
                f"  {name}: {1e3 * wall:.0f} ms, foreign {foreign / wall:.2f} cores",
                file=sys.stderr,
                flush=True,
            )
    for name, rows in results.items():
        keys = sorted({k for r in rows for k in r})
        print(f"\n{name} ({len(rows)} runs; medians, ms; core time = 2 x wall)")
        for key in ["wall", *[k for k in keys if k != "wall"]]:
            values = [1e3 * r.get(key, 0.0) for r in rows]
            print(
                f"  {key:40s} {statistics.median(values):8.1f}  ({', '.join(f'{v:.0f}' for v in values)})"
            )
        if args.phases:
            merged: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
            for by_phase in phase_results[name]:
                for phase, bucket in by_phase.items():
                    for key, value in bucket.items():
                        merged[phase][key] += value / len(rows)
            for phase, bucket in merged.items():
                wall = bucket.pop("wall", 0.0)
                parts = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in sorted(bucket.items()))
                print(f"  phase {phase:8s} wall {1e3 * wall:6.1f} ms: {parts}")


if __name__ == "__main__":
    main()


def dump(start: float, end: float, loop_tid: int) -> None:
    """Print every state change between ``start`` and ``end`` (debugging aid)."""
    names = _thread_names()
    marks = [(t, f"m{m}:{p}") for t, m, p in phases if start <= t <= end]
    rows = [(t, tid, s) for t, tid, s in events if start <= t <= end]
    merged = sorted(
        [(t, "", m) for t, m in marks]
        + [(t, names.get(tid, str(tid))[-12:], s) for t, tid, s in rows]
    )
    for t, who, what in merged:
        print(f"{1e3 * (t - start):8.3f} {who:14s} {what}")
