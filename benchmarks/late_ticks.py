"""Why the 1 ms heartbeat's ticks are late during `concurrent` training (issue #12).

Runs the harness's concurrent case (`concurrency._AioTraining`: 4 models 784-512-512-10,
`asyncio.gather`), by default with every step offloaded (`ag.offload`), and records:

- for each tick, the loop thread's wait on the kernel's run queue since the previous one
  (`/proc/thread-self/schedstat`, Linux): woken, but no core given to it;
- every callback the loop ran (`Handle._run`), with its thread CPU time and its run-queue
  wait (the rest of its time was off CPU: the GIL, a split product's join), and the name of
  each one longer than 1 ms (a task's coroutine, or the callback);
- the cyclic GC's passes, on any thread;
- the workers' BLAS calls inside the CPU budget (their GIL-free time) and their pause sleeps.

For each tick later than `--threshold` ms it attributes the delay to the run queue, the
loop's own callbacks or the GC when that part covers at least half of it ("other": the GIL,
the wake-up itself), and counts the late ticks during which both workers were inside BLAS
calls for at least half of the delay. With ``--natural`` it also tells each run's gather
start (the late tick with 3 or more long callbacks: the coroutines' first forward passes in
one loop iteration) from the rest, prints the pooled p99 without them, and sorts the other
late ticks by how many long callbacks they hold (one coroutine's turn, or more).

    PYTHONPATH=. python benchmarks/late_ticks.py --runs 5
    PYTHONPATH=. python benchmarks/late_ticks.py --runs 5 --natural --show 10
"""

from __future__ import annotations

import argparse
import asyncio
import asyncio.events
import gc
import statistics
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from aioautograd.devices import cpu_budget
from aioautograd.engine import executor
from benchmarks import concurrency

Span = tuple[float, float]
clock = time.perf_counter
blas: list[tuple[int, float, float]] = []  # (thread, start, end) of the budget's BLAS calls
pauses: list[Span] = []  # the workers' pause sleeps
# (start, end, thread CPU, run-queue wait) per loop callback
callbacks: list[tuple[float, float, float, float]] = []
collections: list[Span] = []
long_names: dict[float, str] = {}  # a callback longer than 1 ms, by its start: what it ran
heartbeats: list[Any] = []


def run_queue_wait() -> float:
    """Seconds the calling thread has waited on a run queue since it started (Linux)."""
    with open("/proc/thread-self/schedstat") as stat:
        return int(stat.read().split()[1]) / 1e9


def _callback_name(handle: Any) -> str:
    callback = handle._callback
    owner = getattr(callback, "__self__", None)
    if isinstance(owner, asyncio.Task):
        return f"task {owner.get_coro().__qualname__}"  # type: ignore[union-attr]
    return str(getattr(callback, "__qualname__", callback))


def _install_probes() -> None:
    matmul = np.matmul

    def timed_matmul(a: Any, b: Any, out: Any = None) -> Any:
        start = clock()
        try:
            return matmul(a, b) if out is None else matmul(a, b, out=out)
        finally:
            blas.append((threading.get_ident(), start, clock()))

    # The budget's module sees a NumPy whose matmul is timed (nothing else is changed).
    names = {k: getattr(np, k) for k in dir(np) if not k.startswith("__")}
    cpu_budget.np = types.SimpleNamespace(**{**names, "matmul": timed_matmul})  # type: ignore[assignment]
    sleep = time.sleep

    def timed_sleep(seconds: float) -> None:
        start = clock()
        sleep(seconds)
        pauses.append((start, clock()))

    executor.time = types.SimpleNamespace(  # type: ignore[assignment]
        **{
            **{k: getattr(time, k) for k in dir(time) if not k.startswith("__")},
            "sleep": timed_sleep,
        }
    )
    run = asyncio.events.Handle._run

    def timed_run(self: Any) -> None:
        start, cpu, queued = clock(), time.thread_time(), run_queue_wait()
        run(self)
        end = clock()
        callbacks.append((start, end, time.thread_time() - cpu, run_queue_wait() - queued))
        if end - start > 1e-3:
            long_names[start] = _callback_name(self)

    asyncio.events.Handle._run = timed_run  # type: ignore[method-assign]
    started: list[float] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(clock())
        elif started:
            collections.append((started.pop(), clock()))

    gc.callbacks.append(on_gc)

    class Heartbeat(concurrency.Heartbeat):
        async def _beat(self) -> None:
            heartbeats.append(self)
            self.waits = [run_queue_wait()]
            while not self._stopping:
                await asyncio.sleep(self.period_s)
                self.wakes.append(time.perf_counter())
                self.waits.append(run_queue_wait())

    concurrency.Heartbeat = Heartbeat  # type: ignore[misc]


def _overlap(spans: list[Span], start: float, end: float) -> float:
    return float(sum(min(e, end) - max(s, start) for s, e in spans if e > start and s < end))


def attribute(delay: float, run_queue: float, loop_callbacks: float, collecting: float) -> str:
    """The part that covers at least half of a late tick's ``delay``, else "other"."""
    for name, part in (
        ("run queue", run_queue),
        ("loop callbacks", loop_callbacks),
        ("gc", collecting),
    ):
        if part >= delay / 2:
            return name
    return "other"


async def main(
    runs: int, offload: bool, threshold_ms: float, show: int, size: str = "full"
) -> None:
    _install_probes()
    case = concurrency._AioTraining(
        concurrency._TRAINING_SIZES[size], concurrent=True, offload=offload
    )
    loop_thread = threading.get_ident()
    delays: list[float] = []
    gather_starts: list[float] = []  # natural code: each run's tick behind the first forwards
    late: list[dict[str, Any]] = []
    for run in range(runs + 1):  # (the first run warms up)
        case.prepare()
        case.begin_timed()
        for records in (blas, pauses, callbacks, collections, heartbeats, long_names):
            records.clear()
        await case.run()
        if not run:
            continue
        beat = heartbeats[0]
        first = len(late)
        for i in range(1, len(beat.wakes)):
            due, woke = beat.wakes[i - 1] + beat.period_s, beat.wakes[i]
            delay = max(0.0, woke - due)
            delays.append(delay)
            if delay * 1e3 < threshold_ms:
                continue
            in_blas: dict[int, float] = {}
            for thread, s, e in blas:
                if thread != loop_thread and e > due and s < woke:
                    in_blas[thread] = in_blas.get(thread, 0.0) + min(e, woke) - max(s, due)
            row = {
                "delay": delay,
                "run queue": beat.waits[i] - beat.waits[i - 1],
                "loop callbacks": _overlap([(s, e) for s, e, _, _ in callbacks], due, woke),
                "loop CPU": sum(c for s, e, c, _ in callbacks if e > due and s < woke),
                # inside those callbacks: waiting for a core, and off-CPU (the GIL, a join)
                "cb queued": sum(q for s, e, _, q in callbacks if e > due and s < woke),
                "cb blocked": sum(
                    e - s - c - q for s, e, c, q in callbacks if e > due and s < woke
                ),
                "long cbs": sum(
                    1 for s, e, _, _ in callbacks if e > due and s < woke and e - s > 1e-3
                ),
                "long": [
                    f"{long_names.get(s, '?')} {1e3 * (e - s):.1f}"
                    for s, e, _, _ in callbacks
                    if e > due and s < woke and e - s > 1e-3
                ],
                "gc": _overlap(collections, due, woke),
                "pauses": _overlap(pauses, due, woke),
                "both in BLAS": len(in_blas) >= 2 and min(in_blas.values()) >= delay / 2,
            }
            row["cause"] = attribute(delay, row["run queue"], row["loop callbacks"], row["gc"])
            late.append(row)
        # ``asyncio.gather`` runs the coroutines' first forward passes in one loop iteration:
        # the run's late tick with the most long callbacks, if there are 3 or more.
        starts = sorted(late[first:], key=lambda r: -r["long cbs"])
        if not offload and starts and starts[0]["long cbs"] >= 3:
            starts[0]["gather start"] = True
            gather_starts.append(starts[0]["delay"])
    ms = np.asarray(delays) * 1e3
    print(
        f"{'offload' if offload else 'natural'}: {len(ms)} ticks, p50 {np.percentile(ms, 50):.2f}"
        f" p99 {np.percentile(ms, 99):.2f} max {ms.max():.2f} ms; {len(late)} later than"
        f" {threshold_ms} ms"
    )
    causes = {
        c: sum(1 for r in late if r["cause"] == c)
        for c in ("run queue", "loop callbacks", "gc", "other")
    }
    both = sum(1 for r in late if r["both in BLAS"])
    print(f"late ticks by cause: {causes}; both workers inside BLAS calls: {both}")
    if late:
        waits = [r["run queue"] * 1e3 for r in late]
        print(f"run-queue wait of a late tick: median {statistics.median(waits):.2f} ms")
    if not offload and late:
        _natural_summary(ms, np.asarray(gather_starts) * 1e3, late, runs)
    for row in sorted(late, key=lambda r: -r["delay"])[:show]:
        print(
            "  "
            + ", ".join(
                f"{k} {v * 1e3:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
            )
        )


def _natural_summary(
    ms: np.ndarray[Any, Any], gathers: np.ndarray[Any, Any], late: list[dict[str, Any]], runs: int
) -> None:
    """Natural code: which late ticks set the pooled p99, and what the loop did in them."""
    rest = list(ms)
    for delay in gathers:  # the pooled delays without each run's gather start
        rest.remove(min(rest, key=lambda d: abs(d - delay)))
    print(
        f"ticks per run {len(ms) / runs:.1f}; gather starts {len(gathers)}: "
        f"{', '.join(f'{d:.1f}' for d in sorted(gathers))} ms; "
        f"p99 without them {np.percentile(rest, 99):.2f} ms"
    )
    for floor in (5.0, 10.0):
        rows = [r for r in late if r["delay"] * 1e3 >= floor and not r.get("gather start")]
        if not rows:
            continue
        kinds = {
            "no long callback": sum(1 for r in rows if r["long cbs"] == 0),
            "one turn": sum(1 for r in rows if r["long cbs"] == 1),
            "two or more": sum(1 for r in rows if r["long cbs"] >= 2),
        }
        parts = ("delay", "loop CPU", "cb queued", "cb blocked", "run queue")
        medians = ", ".join(f"{k} {statistics.median(r[k] for r in rows) * 1e3:.2f}" for k in parts)
        print(f"  other ticks >= {floor:.0f} ms: {len(rows)} {kinds}; medians (ms): {medians}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--natural", action="store_true", help="natural code, not offload")
    parser.add_argument("--threshold", type=float, default=1.5, help="late ticks, in ms")
    parser.add_argument("--show", type=int, default=0, help="print the N latest ticks")
    parser.add_argument("--size", default="full", choices=sorted(concurrency._TRAINING_SIZES))
    args = parser.parse_args()
    asyncio.run(main(args.runs, not args.natural, args.threshold, args.show, args.size))
