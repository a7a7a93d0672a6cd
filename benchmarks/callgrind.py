"""Instructions per node (or per op, or per step) of one workload, counted by callgrind.

Wall-clock figures move by 2x on a busy 2-core machine; instruction counts do not. This script
runs a workload of ``benchmarks/workloads.py`` under ``valgrind --tool=callgrind`` and splits
the count into phases with markers: each marker is a call of ``os.getppid()``, and callgrind
(``--dump-before=os_getppid``) writes one profile per marker, holding the instructions
executed by every thread since the previous one. The phases of one repeat are the case's
``prepare()`` (graph building: the forward for the backward-only figures) and its ``run()``
(the timed region of ``benchmarks/run.py``); warm-up repeats run first, uncounted.

Usage::

    python benchmarks/callgrind.py chain                 # aioautograd, full size
    python benchmarks/callgrind.py chain fan small_mlp --impl aioautograd,autograd,mygrad
    python benchmarks/callgrind.py chain --size quick --repeats 3 --json
    python benchmarks/callgrind.py small_mlp --inline-budget 10 --warmup 20 --runs 50

Output: one line per workload and implementation with the instructions of ``run()`` per node
(``nodes`` of the case: ops of a chain or a fan, not counting AccumulateGrad) or per step
where the case has no node count, and of ``prepare()`` per node (the forward per op for the
backward-only figures), the median over the repeats (they agree to within a few hundred
instructions); ``--json`` prints the phases' raw counts too.

Conditions: ``PYTHONHASHSEED=0`` (set iteration order is fixed), a full garbage collection
before each counted phase (so that no phase inherits another's garbage), BLAS and OpenMP
pools at one thread (a spinning idle pool would count instructions that are not the
workload's). callgrind runs about 50x slower than native (the 10,000-node chain takes about
half a minute per implementation), so the engine's time-based policies would decide
differently under it: a worker would pause for the loop every few nodes instead of every few
hundred, and an awaited backward would leave its inline budget after a few nodes. The default
engine's ``gil_hold_s`` and ``inline_budget_s`` are therefore multiplied by ``--time-scale``
(default 50) in the counted process, so that they fire about as often per node as natively.
A scaled budget still runs out now and then on a loaded machine (the small MLP's count then
spreads by ±7%, part of a backward handed to the executors): ``--inline-budget 10`` fixes it
where the backward runs inline natively, so that before/after counts compare.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

_MARKER_SYMBOL = "os_getppid"  # the C function behind os.getppid(), CPython's posixmodule
_TOTALS = re.compile(rb"^(?:totals|summary):\s+([\d ]+)", re.MULTILINE)
_EVENTS = re.compile(rb"^events:\s+([\w ]+)", re.MULTILINE)
_ENV = {
    "PYTHONHASHSEED": "0",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workloads", nargs="+", metavar="WORKLOAD")
    parser.add_argument("--impl", default="aioautograd", help="comma-separated implementations")
    parser.add_argument("--size", default="full", choices=("full", "quick", "tiny"))
    parser.add_argument("--repeats", type=int, default=3, help="counted repeats (median shown)")
    parser.add_argument("--warmup", type=int, default=2, help="uncounted repeats first")
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="run() calls per counted repeat (one prepare() for all: a step case such as small_mlp, "
        "not a backward-only one), the count divided by them (a one-step case's "
        "count then averages over steps: small_mlp's single steps differ by up to 5%%)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=50.0,
        help="multiply the engine's gil_hold_s and inline_budget_s by this (callgrind's slowdown)",
    )
    parser.add_argument(
        "--inline-budget",
        type=float,
        metavar="SECONDS",
        help="fix the engine's inline_budget_s instead of scaling it: a budget that never runs "
        "out (e.g. 10) makes a small backward's count repeatable (small_mlp runs inline natively)",
    )
    parser.add_argument("--json", action="store_true", help="print the raw counts as JSON too")
    parser.add_argument(
        "--sim",
        action="store_true",
        help="simulate the caches and branch predictor: misses and mispredictions per node too",
    )
    parser.add_argument("--inner", metavar="LABELS", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ----------------------------------------------------------------------- inside valgrind


def _inner(args: argparse.Namespace) -> None:
    """Run one workload and implementation; mark the end of each phase for callgrind."""
    import asyncio
    import inspect

    import aioautograd as ag
    from benchmarks.workloads import REGISTRY

    if args.time_scale != 1.0 or args.inline_budget is not None:
        policy = ag.get_default_engine().policy
        inline_budget_s = (
            policy.inline_budget_s * args.time_scale
            if args.inline_budget is None
            else args.inline_budget
        )
        ag.Engine.set_default_engine(
            ag.Engine(
                dataclasses.replace(
                    policy,
                    gil_hold_s=policy.gil_hold_s * args.time_scale,
                    inline_budget_s=inline_budget_s,
                )
            )
        )
    (workload_name,) = args.workloads
    workload = REGISTRY[workload_name]
    (impl,) = [i for i in workload.impls if i.name == args.impl]
    case = impl.factory(workload.sizes[args.size])
    loop = asyncio.new_event_loop()
    labels: list[str] = []

    def mark(label: str) -> None:
        labels.append(label)
        os.getppid()

    async def run() -> None:
        value = case.run()
        if inspect.isawaitable(value):
            await value

    async def counted() -> None:
        # Every run awaited inside one coroutine, as run.py's harness times them: a
        # ``run_until_complete`` per run would count a task and loop iterations (~70k
        # instructions) that the timed region does not include.
        for _ in range(args.warmup):
            case.prepare()
            await run()
        for _ in range(args.repeats):
            gc.collect()
            mark("setup")
            case.prepare()
            mark("prepare")
            gc.collect()
            mark("setup")
            for _ in range(args.runs):
                await run()
            mark("run")

    loop.run_until_complete(counted())
    case.close()
    loop.close()
    Path(args.inner).write_text(json.dumps({"labels": labels, "nodes": case.nodes}))


# ---------------------------------------------------------------------- outside valgrind


def count(workload: str, impl: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run ``workload``/``impl`` under callgrind; the instructions of each counted phase."""
    with tempfile.TemporaryDirectory(prefix="callgrind-") as tmp:
        labels_file = Path(tmp) / "labels.json"
        out = Path(tmp) / "callgrind.out"
        command = [
            "valgrind",
            "--tool=callgrind",
            *(["--cache-sim=yes", "--branch-sim=yes"] if args.sim else []),
            f"--dump-before={_MARKER_SYMBOL}",
            f"--callgrind-out-file={out}",
            sys.executable,
            str(Path(__file__).resolve()),
            workload,
            f"--impl={impl}",
            f"--size={args.size}",
            f"--repeats={args.repeats}",
            f"--warmup={args.warmup}",
            f"--runs={args.runs}",
            f"--time-scale={args.time_scale}",
            *([] if args.inline_budget is None else [f"--inline-budget={args.inline_budget}"]),
            f"--inner={labels_file}",
        ]
        env = {**os.environ, **_ENV}
        subprocess.run(command, check=True, env=env, capture_output=True, cwd=_ROOT)
        meta = json.loads(labels_file.read_text())
        # Dump k (callgrind.out.k) holds the phase that ended at the k-th marker; the one at
        # exit (callgrind.out, no suffix) holds the teardown.
        dumps = sorted(
            (p for p in Path(tmp).glob("callgrind.out.*") if p.suffix[1:].isdigit()),
            key=lambda p: int(p.suffix[1:]),
        )
        events = [_events(p) for p in dumps]
    phases: dict[str, list[int]] = {}
    simulated: dict[str, list[dict[str, int]]] = {}
    for label, counted in zip(meta["labels"], events, strict=True):
        phases.setdefault(label, []).append(counted["Ir"])
        if args.sim:
            simulated.setdefault(label, []).append(counted)
    result = {"workload": workload, "impl": impl, "nodes": meta["nodes"], "phases": phases}
    if args.sim:
        result["simulated"] = simulated
    return result


def _events(path: Path) -> dict[str, int]:
    """The dump's totals by event name (``Ir``; with ``--sim`` also the cache and branch
    events: ``D1mr``, ``DLmr``, ``Bcm``...)."""
    text = path.read_bytes()
    names = _EVENTS.search(text)
    match = _TOTALS.search(text)
    if match is None or names is None:
        raise RuntimeError(f"no totals in {path}")
    return dict(
        zip(names.group(1).decode().split(), map(int, match.group(1).split()), strict=False)
    )


# What --sim prints per node (or per step): sums of callgrind's events.
_SIM_FIGURES = {
    "D1 misses": ("D1mr", "D1mw"),
    "LL misses": ("DLmr", "DLmw", "ILmr"),
    "I1 misses": ("I1mr",),
    "mispredicted": ("Bcm", "Bim"),
    "branches": ("Bc", "Bi"),
}


def _simulated_line(result: dict[str, Any], per: int) -> str:
    runs = result["simulated"]["run"]
    parts = []
    for figure, events in _SIM_FIGURES.items():
        value = statistics.median(sum(run.get(e, 0) for e in events) for run in runs)
        parts.append(f"{figure} {value / per:,.1f}")
    return "    " + ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.inner is not None:
        _inner(args)
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 1
    from benchmarks.workloads import REGISTRY

    for workload in args.workloads:
        for impl_name in args.impl.split(","):
            impls = {i.name: i for i in REGISTRY[workload].impls}
            if impl_name not in impls:
                continue
            reason = impls[impl_name].skip_reason()
            if reason is not None:
                print(f"{workload:12} {impl_name:12} skipped: {reason}")
                continue
            result = count(workload, impl_name, args)
            nodes = result["nodes"]
            run = statistics.median(result["phases"]["run"]) / args.runs
            prepare = statistics.median(result["phases"]["prepare"])
            if nodes:
                print(
                    f"{workload:12} {impl_name:12} run {run / nodes:10,.0f} instr/node  "
                    f"prepare {prepare / nodes:10,.0f} instr/node  ({nodes} nodes)",
                    flush=True,
                )
            else:
                print(
                    f"{workload:12} {impl_name:12} run {run:12,.0f} instr/step  "
                    f"prepare {prepare:12,.0f} instr",
                    flush=True,
                )
            if args.sim:
                print(_simulated_line(result, (nodes or 1) * args.runs), flush=True)
            if args.json:
                print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
