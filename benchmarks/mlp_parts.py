"""Where the `mlp` step's time goes, aioautograd against hand-written NumPy (issue #12).

Two views of the step of ``benchmarks/workloads.py`` (784-1024-1024-10, batch 256):

- ``--phases`` (default environment): wall time of the forward (with the loss), the backward
  and the SGD update, both sides alternated, each block of steps started once the machine was
  at least 90% idle over 0.25 s (``budget_ab.wait_until_idle``).
- ``--products`` (run it with ``OPENBLAS_NUM_THREADS=1``): CPU time of each of the 8 matrix
  products inside the step, and of the step itself, on one core (an engine with one core and
  every node inline on the loop's thread), so that the work outside the products shows.

- ``--handoffs`` (default environment): the backward's thread hand-offs, gated as
  ``--phases``: how long the products took (wall), the workers' pauses (``pause_if_due``
  sleeps), the wait from the loop's last inline node to the first node on a worker, and from
  the last worker node to ``await loss.backward()`` returning.

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. python benchmarks/mlp_parts.py --products
    PYTHONPATH=. python benchmarks/mlp_parts.py --phases --rounds 20
    PYTHONPATH=. python benchmarks/mlp_parts.py --handoffs --rounds 10
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aioautograd as ag
from aioautograd.devices import cpu_budget
from aioautograd.engine import evaluate, executor, inline
from benchmarks import workloads as W
from benchmarks.budget_ab import wait_until_idle

PARAMS = {"widths": [784, 1024, 1024, 10], "batch": 256}
Clock = Callable[[], float]


class _Parts:
    """Both sides of the step with marks between forward, backward and update; ``product``
    is the matrix product the NumPy side calls (swapped for a timed one by ``--products``)."""

    def __init__(self) -> None:
        self.aio = W._AioMlp(PARAMS)
        self.np = W._NumpyMlp(PARAMS)
        self.product: Callable[[Any, Any], Any] = np.matmul

    async def aio_step(self, clock: Clock) -> tuple[float, float, float]:
        case = self.aio
        t0 = clock()
        loss = case.forward_loss()
        t1 = clock()
        await loss.backward()
        t2 = clock()
        with ag.no_grad():
            for p in case.params:
                p.sub_(p.grad, alpha=W.LEARNING_RATE)
                p.grad = None
        return t1 - t0, t2 - t1, clock() - t2

    def numpy_step(self, clock: Clock) -> tuple[float, float, float]:
        # ``_NumpyMlp.run`` with the same marks (kept equal to it: same operations, in place).
        case, product = self.np, self.product
        weights, biases = case.weights, case.biases
        t0 = clock()
        activations, h, last = [case.inputs], case.inputs, len(weights) - 1
        for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
            h = product(h, w)
            h += b
            if i < last:
                np.maximum(h, 0.0, out=h)
                activations.append(h)
        logits = h
        logits -= logits.max(axis=1, keepdims=True)
        probs = np.exp(logits)
        norm = probs.sum(axis=1, keepdims=True)
        float(np.log(norm[:, 0]).mean() - logits[case.rows, case.targets].mean())
        t1 = clock()
        probs /= norm
        probs[case.rows, case.targets] -= 1.0
        probs /= case.inputs.shape[0]
        grad = probs
        weight_grads: list[Any] = [None] * len(weights)
        bias_grads: list[Any] = [None] * len(weights)
        for i in range(last, -1, -1):
            weight_grads[i] = product(activations[i].T, grad)
            bias_grads[i] = grad.sum(axis=0)
            if i > 0:
                grad = product(grad, weights[i].T)
                grad *= activations[i] > 0
        t2 = clock()
        for param, param_grad in zip(weights + biases, weight_grads + bias_grads, strict=True):
            param_grad *= W.LEARNING_RATE
            param -= param_grad
        return t1 - t0, t2 - t1, clock() - t2


def _ms(values: list[float]) -> str:
    return f"median {statistics.median(values) * 1e3:6.2f} min {min(values) * 1e3:6.2f} ms"


async def phases(rounds: int) -> None:
    parts = _Parts()
    results: dict[str, list[tuple[float, float, float]]] = {"aioautograd": [], "numpy": []}
    for _ in range(rounds):
        wait_until_idle()
        for i in range(3):
            timing = await parts.aio_step(time.perf_counter)
            if i:  # the first step of a block warms the caches back up
                results["aioautograd"].append(timing)
        wait_until_idle()
        for i in range(3):
            timing = parts.numpy_step(time.perf_counter)
            if i:
                results["numpy"].append(timing)
    for name, rows in results.items():
        columns = list(zip(*rows, strict=True))
        totals = [sum(row) for row in rows]
        print(f"{name:12s}", end="")
        for label, column in zip(("forward", "backward", "update"), columns, strict=True):
            print(f" | {label} {_ms(list(column))}", end="")
        print(f" | step {_ms(totals)}")


async def products(steps: int) -> None:
    one_core = ag.EnginePolicy(
        cpu_cores=1, inline_max_elements=1 << 30, inline_max_flops=math.inf, inline_budget_s=10.0
    )
    previous = ag.set_default_engine(ag.Engine(policy=one_core))
    parts = _Parts()
    clock = time.process_time
    aio_times: list[list[float]] = []
    np_times: list[list[float]] = []
    budget_matmul = cpu_budget.CpuBudget.matmul

    def timed_budget(self: Any, a: Any, b: Any) -> Any:
        start = clock()
        out = budget_matmul(self, a, b)
        aio_times[-1].append(clock() - start)
        return out

    def timed_numpy(a: Any, b: Any) -> Any:
        start = clock()
        out = np.matmul(a, b)
        np_times[-1].append(clock() - start)
        return out

    cpu_budget.CpuBudget.matmul = timed_budget  # type: ignore[method-assign]
    parts.product = timed_numpy
    aio_steps, np_steps = [], []
    try:
        for _ in range(steps):
            aio_times.append([])
            aio_steps.append(sum(await parts.aio_step(clock)))
            np_times.append([])
            np_steps.append(sum(parts.numpy_step(clock)))
    finally:
        cpu_budget.CpuBudget.matmul = budget_matmul  # type: ignore[method-assign]
        if previous is not None:
            ag.set_default_engine(previous)
    warm = steps // 5
    for name, step_times, product_times in (
        ("aioautograd", aio_steps[warm:], aio_times[warm:]),
        ("numpy", np_steps[warm:], np_times[warm:]),
    ):
        per_product = [statistics.median(column) for column in zip(*product_times, strict=True)]
        in_products = [sum(row) for row in product_times]
        outside = [s - p for s, p in zip(step_times, in_products, strict=True)]
        print(
            f"{name:12s} step {_ms(step_times)} | 8 products {_ms(in_products)} | "
            f"outside {_ms(outside)}"
        )
        print(
            "             products (ms, in call order): "
            + " ".join(f"{t * 1e3:.2f}" for t in per_product)
        )


class _Recorder:
    """Spans ``(thread, kind, start, end)`` of nodes, products (matmul and pairs) and the
    workers' pause sleeps, recorded by wrappers installed for the duration of a ``with``."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, float, float]] = []
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, owner: Any, name: str, kind: str) -> None:
        original = getattr(owner, name)
        spans, clock = self.spans, time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return original(*args, **kwargs)
            finally:
                spans.append((threading.current_thread().name, kind, start, clock()))

        self._saved.append((owner, name, original))
        setattr(owner, name, timed)

    def __enter__(self) -> _Recorder:
        devices = importlib.import_module("aioautograd.devices.device")
        self._wrap(evaluate, "evaluate_function", "node")
        self._wrap(inline, "evaluate_function", "node")
        self._wrap(cpu_budget.CpuBudget, "matmul", "product")
        if hasattr(devices.CpuBackend, "matmul_pair"):  # (not in trees before session 23)
            self._wrap(devices.CpuBackend, "matmul_pair", "product")
        # time.sleep, process-wide while recording: during the backward, only the workers'
        # pause_if_due sleeps.
        self._wrap(executor.time, "sleep", "pause")
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)


async def handoffs(rounds: int, gated: bool = True) -> None:
    parts = _Parts()
    rows: dict[str, list[float]] = {
        k: [] for k in ("backward", "products", "pauses", "to worker", "to loop")
    }
    with _Recorder() as recorder:
        for _ in range(rounds):
            if gated:
                wait_until_idle()
            for i in range(3):
                recorder.spans.clear()
                start = time.perf_counter()
                forward, backward, _ = await parts.aio_step(time.perf_counter)
                if not i:
                    continue
                began, ended = start + forward, start + forward + backward
                spans = [s for s in recorder.spans if began <= s[2] < ended]
                nodes = [s for s in spans if s[1] == "node"]
                on_loop = [s[3] for s in nodes if s[0] == "MainThread"] or [began]
                on_workers = [s for s in nodes if s[0] != "MainThread"]
                rows["backward"].append(backward)
                products = [s for s in spans if s[1] == "product"]
                outer = [  # (a pair that falls back to two products records both levels)
                    s
                    for s in products
                    if not any(
                        o is not s and o[0] == s[0] and o[2] <= s[2] <= s[3] <= o[3]
                        for o in products
                    )
                ]
                rows["products"].append(sum(s[3] - s[2] for s in outer))
                rows["pauses"].append(sum(s[3] - s[2] for s in spans if s[1] == "pause"))
                if on_workers:
                    rows["to worker"].append(min(s[2] for s in on_workers) - max(on_loop))
                    rows["to loop"].append(ended - max(s[3] for s in on_workers))
    print("backward, per step: " + " | ".join(f"{k} {_ms(v)}" for k, v in rows.items() if v))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--products", action="store_true", help="one-core product split")
    parser.add_argument("--phases", action="store_true", help="gated phase timing (default)")
    parser.add_argument("--handoffs", action="store_true", help="the backward's hand-offs")
    parser.add_argument("--rounds", type=int, default=20, help="gated rounds (--phases, ...)")
    parser.add_argument("--steps", type=int, default=40, help="steps for --products")
    args = parser.parse_args()
    if args.products:
        asyncio.run(products(args.steps))
    if args.handoffs:
        asyncio.run(handoffs(args.rounds))
    if args.phases or not (args.products or args.handoffs):
        asyncio.run(phases(args.rounds))


if __name__ == "__main__":
    main()
