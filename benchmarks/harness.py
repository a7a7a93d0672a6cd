"""Timing loop, JSON lines and the markdown table of ratios (used by ``run.py``)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import inspect
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

import aioautograd as ag
from benchmarks.workloads import SUBJECT, Case, Workload, format_seconds

# Table columns: the two baselines spec §8 names first, then the optional libraries.
BASELINE_ORDER = ("torch", "numpy", "autograd", "mygrad")


@dataclass
class Result:
    name: str
    impl: str
    median_s: float
    min_s: float
    max_s: float
    repeats: int
    warmup: int
    nodes: int | None
    first_value: float
    extras: dict[str, Any]
    # A variant (``Impl.main_table`` false) has no column in the main tables; its workload's
    # own summary table shows it.
    variant: bool = False

    @property
    def per_node_us(self) -> float | None:
        return None if self.nodes is None else self.median_s / self.nodes * 1e6

    def as_json(self) -> dict[str, Any]:
        line: dict[str, Any] = {
            "name": self.name,
            "impl": self.impl,
            "median_s": self.median_s,
            "min_s": self.min_s,
            "max_s": self.max_s,
            "repeats": self.repeats,
            "warmup": self.warmup,
        }
        if self.nodes is not None:
            line["nodes"] = self.nodes
            line["per_node_us"] = round(self.per_node_us or 0.0, 4)
        line["first_value"] = self.first_value
        line.update(self.extras)
        return line


async def run_case(case: Case) -> float:
    """One untimed ``prepare`` and one ``run``; returns the run's (finite) value."""
    case.prepare()
    value = case.run()
    if inspect.isawaitable(value):
        value = await value
    return float(value)


# Timed runs per case per interleaved round, after its untimed re-warming run. Timing a case
# right after other implementations' code ran (one run per case per round) let the cache
# state decide the comparison: our small-MLP step ran ~10% faster right after a variant of
# itself, mygrad's ~25% slower than back to back (benchmarks/README, session 25).
INTERLEAVE_TIMED = 3

# Least warm-up time per implementation in blocked mode: long enough for the thread pools of
# the implementation that ran before (OpenBLAS, torch's OpenMP) to stop spinning, which on two
# cores would otherwise steal a core from the one being timed.
MIN_WARMUP_S = 0.3


async def _time_once(name: str, impl: str, case: Case) -> tuple[float, float]:
    """``prepare`` (untimed), then one timed ``run``: (seconds, finite value)."""
    case.prepare()
    start = time.perf_counter()
    outcome = case.run()
    if inspect.isawaitable(outcome):
        outcome = await outcome
    elapsed = time.perf_counter() - start
    if case.timed_s is not None:  # the case timed its own region (e.g. only the backward)
        elapsed, case.timed_s = case.timed_s, None
    value = float(outcome)
    if not math.isfinite(value):
        raise FloatingPointError(f"{name}/{impl} gave {value}")
    return elapsed, value


async def measure(
    name: str, cases: dict[str, Case], warmup: int, repeats: int, interleave: bool = False
) -> list[Result]:
    """Time ``cases`` (implementation name -> case).

    By default each implementation runs as a block: its warm-up (``warmup`` runs, and at
    least ``MIN_WARMUP_S``), then its ``repeats`` timed runs. With ``interleave``, rounds run
    every case once each (rotating the order), so that bursts of background load fall on all
    implementations alike; each case gets one untimed run before its timed runs of the round
    (``INTERLEAVE_TIMED``), so that none is timed on caches the others left; but the thread
    pools of the previous case may still spin, which on a 2-core machine slowed BLAS-bound
    steps up to ~3x.
    """
    impls = list(cases)
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    # The value of each implementation's first run: every one starts from the same inputs
    # and weights, so these agree across implementations (later MLP losses differ, as the
    # implementations take different numbers of SGD steps).
    values: dict[str, float] = {}
    try:
        await _time_all(name, cases, warmup, repeats, interleave, times, values)
    finally:
        for case in cases.values():  # a no-op where already closed
            case.close()
    return [
        Result(
            name=name,
            impl=impl,
            median_s=statistics.median(times[impl]),
            min_s=min(times[impl]),
            max_s=max(times[impl]),
            repeats=repeats,
            warmup=warmup,
            nodes=cases[impl].nodes,
            first_value=values[impl],
            extras=cases[impl].extras(),
        )
        for impl in impls
    ]


async def _time_all(
    name: str,
    cases: dict[str, Case],
    warmup: int,
    repeats: int,
    interleave: bool,
    times: dict[str, list[float]],
    values: dict[str, float],
) -> None:
    """The timing loops of ``measure``: fill ``times`` and ``values`` per implementation. In
    blocked mode a case is closed as soon as its block ends (its worker processes, if any,
    do not idle beside the next implementation)."""
    impls = list(cases)
    if interleave:
        # Each round gives every case a short block: one untimed run that brings its own
        # code and data back into the caches (the other cases ran since), then up to
        # INTERLEAVE_TIMED timed runs, as a training loop runs step after step.
        warm_rounds = math.ceil(warmup / INTERLEAVE_TIMED)
        rounds = warm_rounds + math.ceil(repeats / INTERLEAVE_TIMED)
        for round_index in range(rounds):
            if round_index == warm_rounds:  # the statistics a case keeps count from here on
                for case in cases.values():
                    case.begin_timed()
            shift = round_index % len(impls)
            for impl in impls[shift:] + impls[:shift]:
                _, value = await _time_once(name, impl, cases[impl])
                values.setdefault(impl, value)
                timed = times[impl]
                for _ in range(INTERLEAVE_TIMED):
                    if round_index >= warm_rounds and len(timed) == repeats:
                        break
                    elapsed, _ = await _time_once(name, impl, cases[impl])
                    if round_index >= warm_rounds:
                        timed.append(elapsed)
                        cases[impl].kept()
    else:
        for impl in impls:
            deadline = time.perf_counter() + MIN_WARMUP_S
            done = 0
            while done < warmup or time.perf_counter() < deadline:
                _, value = await _time_once(name, impl, cases[impl])
                values.setdefault(impl, value)
                done += 1
            cases[impl].begin_timed()
            for _ in range(repeats):
                elapsed, value = await _time_once(name, impl, cases[impl])
                values.setdefault(impl, value)
                times[impl].append(elapsed)
                cases[impl].kept()
            cases[impl].close()


def blas_threads() -> int | None:
    """Threads NumPy's OpenBLAS uses, asked from the library itself when it can be found."""
    import ctypes
    import glob

    libs = glob.glob(os.path.join(os.path.dirname(np.__file__) + ".libs", "*openblas*"))
    for path in libs:
        lib = ctypes.CDLL(path)
        for symbol in (
            "scipy_openblas_get_num_threads64_",
            "scipy_openblas_get_num_threads",
            "openblas_get_num_threads64_",
            "openblas_get_num_threads",
        ):
            getter = getattr(lib, symbol, None)
            if getter is not None:
                return int(getter())
    return None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def environment(threads: int, loop: str) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "numpy": np.__version__,
        "numpy_blas_threads": blas_threads(),
        "aioautograd": ag.__version__,
        "engine_cpu_threads": ag.get_default_engine().num_cpu_threads,
        "event_loop": loop,
        "threads_requested": threads,
        "loadavg": os.getloadavg(),
    }
    try:
        import torch
    except ImportError:
        env["torch"] = None
    else:
        torch.set_num_threads(threads)
        with contextlib.suppress(RuntimeError):  # already set once parallel work started
            torch.set_num_interop_threads(1)
        env["torch"] = torch.__version__
        env["torch_threads"] = torch.get_num_threads()
        env["torch_interop_threads"] = torch.get_num_interop_threads()
    for optional in ("autograd", "mygrad"):
        try:
            env[optional] = importlib.metadata.version(optional)
        except importlib.metadata.PackageNotFoundError:
            env[optional] = None
    return env


def _emit(line: dict[str, Any]) -> None:
    print(json.dumps(line), flush=True)


async def run_workload(
    workload: Workload, size: str, impls: set[str] | None = None, interleave: bool = False
) -> tuple[list[Result], str | None]:
    """Measure ``workload``; print its JSON lines (and its summary's); return the results and
    the summary's markdown table, if the workload has one."""
    params = workload.sizes[size]
    warmup, repeats = workload.repeats[size]
    cases: dict[str, Case] = {}
    variants = {impl.name for impl in workload.impls if not impl.main_table}
    for impl in workload.impls:
        if impls is not None and impl.name not in impls:
            continue
        reason = impl.skip_reason()
        if reason is not None:
            _emit({"name": workload.name, "impl": impl.name, "skipped": reason})
        else:
            cases[impl.name] = impl.factory(params)
    results = await measure(workload.name, cases, warmup, repeats, interleave)
    lines: dict[str, dict[str, Any]] = {}
    for result in results:
        result.variant = result.impl in variants
        lines[result.impl] = {**result.as_json(), "params": params}
        _emit(lines[result.impl])
    table = None
    if workload.summary is not None and lines:
        summary, table = workload.summary(lines)
        _emit({"name": workload.name, "summary": summary})
    return results, table


async def run_all(
    workloads: list[Workload],
    size: str,
    threads: int,
    loop: str,
    impls: set[str] | None = None,
    interleave: bool = False,
) -> None:
    start = time.perf_counter()
    _emit({"env": {**environment(threads, loop), "interleave": interleave}})
    results: dict[str, list[Result]] = {}
    tables: dict[str, str] = {}
    for workload in workloads:
        results[workload.name], table = await run_workload(workload, size, impls, interleave)
        if table is not None:
            tables[workload.name] = table
    # Load average at the end: a busy machine (other jobs) shows here.
    _emit({"done": {"wall_s": round(time.perf_counter() - start, 1), "loadavg": os.getloadavg()}})
    print()
    print("Medians:")
    print()
    print(markdown_table(results, "median_s"))
    print()
    print("Minima (least disturbed by other load on the machine):")
    print()
    print(markdown_table(results, "min_s"))
    for name, table in tables.items():
        print()
        print(f"`{name}`:")
        print()
        print(table)
    sys.stdout.flush()


def markdown_table(results: dict[str, list[Result]], stat: str = "median_s") -> str:
    """One row per figure: ``stat`` (``median_s`` or ``min_s``) of every implementation, and
    the subject's ratios to each baseline. Variants only appear in their workload's summary."""
    seen = {r.impl for row in results.values() for r in row if not r.variant} - {SUBJECT}
    baselines = [b for b in BASELINE_ORDER if b in seen] + sorted(seen - set(BASELINE_ORDER))
    header = ["figure", SUBJECT, *baselines, *(f"{SUBJECT} / {b}" for b in baselines)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, row in results.items():
        by_impl = {r.impl: r for r in row}
        subject = by_impl.get(SUBJECT)

        def cell(impl: str, by_impl: dict[str, Result] = by_impl) -> str:
            result = by_impl.get(impl)
            if result is None:
                return "—"
            seconds = getattr(result, stat)
            text = format_seconds(seconds)
            if result.nodes is not None:
                text += f" ({seconds / result.nodes * 1e6:.3g} µs/node)"
            return text

        ratios = []
        for baseline in baselines:
            other = by_impl.get(baseline)
            if subject is None or other is None:
                ratios.append("—")
            else:
                ratios.append(f"{getattr(subject, stat) / getattr(other, stat):.2f}x")
        cells = [name, cell(SUBJECT), *(cell(b) for b in baselines), *ratios]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
