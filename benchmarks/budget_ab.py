"""A/B of CPU-budget knobs on the `concurrent` training schedules, alternated run by run.

On a shared 2-core machine a figure taken in one block and compared with another block
minutes later mostly measures the neighbours' load. This script alternates the settings run
by run inside one process, and before each run waits (up to 20 s) until the machine looks
idle (``/proc/stat``, Linux), so both settings see the same background. It changes the
process's budget in place (``cpu_budget()``), the way ``set_default_engine`` would.

    python benchmarks/budget_ab.py --runs 5 --setting hold0:loop_hold_s=0 \
        --setting hold1:loop_hold_s=0.001 --schedule conc,seq,conc-off

Each run also measures the CPU time that other processes used meanwhile (``/proc/stat``
minus this process's own, in cores); with ``--max-foreign`` a run over that is dropped and
run again (up to ``--max-tries`` per kept run), so that the figures compare runs the
neighbours left alone. The tick figures: ``p99`` pooled over the kept runs (as the harness
pools its 8 timed runs), ``2nd`` the median over runs of each run's second-longest delay
(with ~90 ticks a run, what the pooled p99 mostly measures), ``max`` the longest.

Settings name ``CpuBudget`` attributes (``loop_hold_s``, ``slice_flops``, ``intra_op``...).
Schedules: ``conc`` (natural code, ``asyncio.gather``), ``seq`` (natural, one model after
another), ``conc-off`` / ``seq-off`` (the ``offload`` step); ``--size mid`` uses
``concurrent_mid``'s shapes. Output: per schedule and setting, the median and minimum wall
time and the 1 ms heartbeat's tick count, p99 and longest delay.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from aioautograd.devices.cpu_budget import cpu_budget
from benchmarks import concurrency


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:]]
    return values[3] + values[4], sum(values)  # idle + iowait, total


def _own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def _busy_s() -> float:
    """CPU seconds all processes used since boot (``/proc/stat``; 0 where unreadable)."""
    try:
        idle, total = _cpu_times()
    except OSError:
        return 0.0
    return (total - idle) / os.sysconf("SC_CLK_TCK")


def wait_until_idle(threshold: float = 0.9, limit_s: float = 20.0) -> bool:
    """Wait until the machine was at least ``threshold`` idle over 0.25 s (False: gave up)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            idle0, total0 = _cpu_times()
        except OSError:
            return True  # not Linux: cannot tell
        time.sleep(0.25)
        idle1, total1 = _cpu_times()
        if (idle1 - idle0) / max(1, total1 - total0) >= threshold:
            return True
    return False


def _parse_setting(text: str) -> tuple[str, dict[str, Any]]:
    name, _, assignments = text.partition(":")
    values: dict[str, Any] = {}
    for assignment in filter(None, assignments.split("+")):
        key, _, raw = assignment.partition("=")
        try:
            values[key] = float(raw)
        except ValueError:
            values[key] = raw
    return name, values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--setting", action="append", required=True, help="name:attr=v+attr=v")
    parser.add_argument("--schedule", default="conc,seq,conc-off")
    parser.add_argument("--size", choices=("full", "mid"), default="full")
    parser.add_argument(
        "--max-foreign",
        type=float,
        default=None,
        help="drop runs during which other processes used more cores than this",
    )
    parser.add_argument("--max-tries", type=int, default=4)
    args = parser.parse_args()
    sizes = concurrency._TRAINING_SIZES if args.size == "full" else concurrency._TRAINING_MID_SIZES
    params = sizes["full"]
    settings = dict(_parse_setting(s) for s in args.setting)
    schedules = args.schedule.split(",")
    budget = cpu_budget()
    cases = {
        s: concurrency._AioTraining(params, s.startswith("conc"), s.endswith("-off"))
        for s in schedules
    }
    loop = asyncio.new_event_loop()
    results: dict[tuple[str, str], tuple[list[float], list[list[float]], list[float]]] = {
        (s, n): ([], [], []) for s in schedules for n in settings
    }
    for case in cases.values():  # warm-up
        case.prepare()
        loop.run_until_complete(case.run())
    busy = dropped = 0
    for _ in range(args.runs):
        for schedule, case in cases.items():
            for name, values in settings.items():
                for key, value in values.items():
                    setattr(budget, key, value)
                for _attempt in range(args.max_tries):
                    busy += not wait_until_idle()
                    case.begin_timed()
                    case.prepare()
                    own0, all0, wall0 = _own_cpu_s(), _busy_s(), time.perf_counter()
                    loop.run_until_complete(case.run())
                    elapsed = time.perf_counter() - wall0
                    foreign = max(0.0, (_busy_s() - all0) - (_own_cpu_s() - own0)) / elapsed
                    if args.max_foreign is None or foreign <= args.max_foreign:
                        break
                    dropped += 1
                print(
                    f"  {schedule} {name}: {1e3 * case.timed_s:.0f} ms, foreign {foreign:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
                walls, ticks, foreigns = results[(schedule, name)]
                walls.append(case.timed_s)
                ticks.append(list(case.delays_ms))
                foreigns.append(foreign)
    for (schedule, name), (walls, ticks, foreigns) in results.items():
        delays = np.asarray([d for run in ticks for d in run] or [0.0])
        second = statistics.median(sorted(run)[-2] if len(run) > 1 else 0.0 for run in ticks)
        print(
            f"{schedule:9s} {name:12s} wall median {1e3 * statistics.median(walls):6.1f} ms "
            f"min {1e3 * min(walls):6.1f} ms  ticks/run {len(delays) / len(walls):5.1f} "
            f"p99 {np.percentile(delays, 99):5.1f} ms 2nd {second:5.1f} ms "
            f"max {delays.max():5.1f} ms  foreign {statistics.median(foreigns):.2f} cores"
        )
    print(f"runs started on a busy machine: {busy}; dropped for foreign load: {dropped}")


if __name__ == "__main__":
    main()
