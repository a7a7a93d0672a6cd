"""A/B of CPU-budget knobs on the `concurrent` training schedules, alternated run by run.

On a shared 2-core machine a figure taken in one block and compared with another block
minutes later mostly measures the neighbours' load. This script alternates the settings run
by run inside one process, and before each run waits (up to 20 s) until the machine looks
idle (``/proc/stat``, Linux), so both settings see the same background. It changes the
process's budget in place (``cpu_budget()``), the way ``set_default_engine`` would.

    python benchmarks/budget_ab.py --runs 5 --setting hold0:loop_hold_s=0 \
        --setting hold1:loop_hold_s=0.001 --schedule conc,seq,conc-off

Settings name ``CpuBudget`` attributes (``loop_hold_s``, ``slice_flops``, ``intra_op``...).
Schedules: ``conc`` (natural code, ``asyncio.gather``), ``seq`` (natural, one model after
another), ``conc-off`` / ``seq-off`` (the ``offload`` step); ``--size mid`` uses
``concurrent_mid``'s shapes. Output: per schedule and setting, the median and minimum wall
time and the 1 ms heartbeat's tick count, p99 and longest delay.
"""

from __future__ import annotations

import argparse
import asyncio
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
    results: dict[tuple[str, str], tuple[list[float], list[float]]] = {
        (s, n): ([], []) for s in schedules for n in settings
    }
    for case in cases.values():  # warm-up
        case.prepare()
        loop.run_until_complete(case.run())
    busy = 0
    for _ in range(args.runs):
        for schedule, case in cases.items():
            for name, values in settings.items():
                for key, value in values.items():
                    setattr(budget, key, value)
                busy += not wait_until_idle()
                case.begin_timed()
                case.prepare()
                loop.run_until_complete(case.run())
                walls, ticks = results[(schedule, name)]
                walls.append(case.timed_s)
                ticks.extend(case.delays_ms)
    for (schedule, name), (walls, ticks) in results.items():
        delays = np.asarray(ticks or [0.0])
        print(
            f"{schedule:9s} {name:12s} wall median {1e3 * statistics.median(walls):6.1f} ms "
            f"min {1e3 * min(walls):6.1f} ms  ticks {len(ticks):4d} "
            f"p99 {np.percentile(delays, 99):5.1f} ms max {delays.max():5.1f} ms"
        )
    print(f"runs started on a busy machine: {busy}")


if __name__ == "__main__":
    main()
