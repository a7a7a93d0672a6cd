"""Run the spec §8 benchmarks side by side and print one JSON line per figure and a table.

Usage::

    python benchmarks/run.py                 # full run (a couple of minutes on 2 cores)
    python benchmarks/run.py --quick         # smaller sizes, fewer repeats
    python benchmarks/run.py --only chain --only mlp
    python benchmarks/run.py --only mlp --impl aioautograd,numpy
    python benchmarks/run.py --threads 1     # BLAS and torch intra-op threads
    python benchmarks/run.py --interleave --only chain,fan --impl aioautograd,aioautograd-paired
                                             # + fan / chain timed in pairs (fan's summary)

Every implementation of a figure runs in this one process, one after the other, on the same
inputs. Each repeat times one call of the case's ``run`` (``prepare`` runs untimed before it);
a warm-up precedes the timed repeats and median/min/max are reported. The first JSON line
(``"env"``) describes the machine, the library versions and the thread counts.

Threads: NumPy's BLAS (OpenBLAS) and torch's intra-op pool both get ``--threads`` (default:
the core count), set through ``OPENBLAS_NUM_THREADS``/``OMP_NUM_THREADS``/``MKL_NUM_THREADS``
before NumPy is imported and through ``torch.set_num_threads``; torch's inter-op pool gets 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))  # so `python benchmarks/run.py` works from a checkout


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    parser.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help="run only this workload (repeatable, or comma-separated)",
    )
    parser.add_argument(
        "--impl",
        action="append",
        metavar="NAME",
        help="run only these implementations (repeatable, or comma-separated)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="BLAS and torch intra-op threads (default: os.cpu_count())",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="alternate implementations repeat by repeat instead of timing each as a block",
    )
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    parser.add_argument("--list", action="store_true", help="list the workloads and exit")
    return parser.parse_args(argv)


def _set_thread_env(threads: int) -> None:
    # Must happen before NumPy (and its OpenBLAS) is imported.
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(threads)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    threads = args.threads or os.cpu_count() or 1
    _set_thread_env(threads)

    import asyncio

    from benchmarks import harness
    from benchmarks.workloads import REGISTRY

    if args.list:
        for workload in REGISTRY.values():
            print(f"{workload.name:14} {workload.description}")
        return 0
    requested = {n for item in args.only or [] for n in item.split(",") if n}
    unknown = sorted(requested - REGISTRY.keys())
    if unknown:
        print(f"unknown workload(s) {unknown}; known: {list(REGISTRY)}", file=sys.stderr)
        return 2

    loop_factory = None
    if args.loop == "uvloop":
        import uvloop

        loop_factory = uvloop.new_event_loop
    names = [n for n in REGISTRY if not requested or n in requested]  # registry order
    impls = {n for item in args.impl or [] for n in item.split(",") if n} or None
    size = "quick" if args.quick else "full"
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(
            harness.run_all(
                [REGISTRY[n] for n in names], size, threads, args.loop, impls, args.interleave
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
