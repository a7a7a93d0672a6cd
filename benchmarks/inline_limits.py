"""How long the event loop can be held by one inline node (issue #15, the loop's budget of #12).

Inline execution (``aioautograd/engine/inline.py``) runs a node on the loop's thread when its
predicted cost fits the engine's policy: elements for element-wise nodes (weighted by
``Node._element_cost``), elements and flops for matrix products. Two views:

- ``--limits`` (default): for each node class below, the largest input (``rows x 64``, or a
  ``linear`` layer ``rows x k -> k``) whose node the default policy lets run inline, and
  how long its backward then takes on this thread (median and minimum of ``--runs``), in
  float32 and float64: the longest a node may hold the loop beyond the budget.
- ``--heartbeat``: a 1 ms heartbeat on the loop while ``await loss.backward()`` runs a GELU
  backward over 128x128 float64 (16,384 elements) again and again (``retain_graph``; the
  forward is not timed): the ticks' longest and 99th-percentile delays. Uses the public API
  only, so that an older tree can run it (``PYTHONPATH=<tree>``).

Usage::

    PYTHONPATH=. python benchmarks/inline_limits.py
    PYTHONPATH=. python benchmarks/inline_limits.py --heartbeat --passes 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import aioautograd as ag
import aioautograd.nn.functional as F

WIDTH = 64
_rng = np.random.default_rng(0)


def _indices(high: int, shape: tuple[int, ...]) -> ag.Tensor:
    return ag.tensor(_rng.integers(0, high, shape))


NODES: dict[str, Callable[[ag.Tensor], ag.Tensor]] = {
    "relu": lambda x: x.relu(),
    "tanh": lambda x: x.tanh(),
    "div": lambda x: x / (x + 1.0),
    "clamp": lambda x: x.clamp(0.2, 0.8),
    "where": lambda x: ag.where(x > 0.5, x, x * 2),
    "softmax": lambda x: F.softmax(x, -1),
    "log_softmax": lambda x: F.log_softmax(x, -1),
    "gelu": lambda x: F.gelu(x),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "sin": lambda x: x.sin(),
    "var": lambda x: x.var(-1),
    "logsumexp": lambda x: x.logsumexp(-1),
    "tensor_exponent": lambda x: (x * x + 0.5) ** x,
    "maximum": lambda x: ag.maximum(x, x * 0.5),
    "cumsum": lambda x: x.cumsum(-1),
    "norm": lambda x: x.norm(dim=-1),
    "index": lambda x: x[_indices(x.shape[0], (x.shape[0],))],
    "gather": lambda x: x.gather(1, _indices(x.shape[1], x.shape)),
    "embedding": lambda x: F.embedding(_indices(x.shape[0], (x.shape[0],)), x),
}


def _node_of(name: str, rows: int, dtype: str) -> tuple[Any, ag.Tensor]:
    """The backward node of ``name`` on a ``rows`` x 64 input (or a linear layer) and the
    gradient it receives."""
    if name.startswith("linear"):
        k = int(name.split("_")[1])
        x = ag.randn(rows, k, dtype=dtype, requires_grad=True)
        weight = ag.randn(k, k, dtype=dtype, requires_grad=True)
        out = F.linear(x, weight, ag.randn(k, dtype=dtype, requires_grad=True))
    else:
        data = _rng.uniform(0.1, 0.9, (rows, WIDTH))
        out = NODES[name](ag.tensor(data, dtype=dtype, requires_grad=True))
    return out.grad_fn, ag.ones(out.shape, dtype=dtype)


def largest_inline(name: str, dtype: str) -> int:
    """The most rows whose node the default engine's policy lets run inline (bisection)."""
    from aioautograd.engine import EnginePolicy
    from aioautograd.engine.inline import qualifies

    policy = EnginePolicy()

    def fits(rows: int) -> bool:
        node, grad = _node_of(name, rows, dtype)
        return qualifies(node, [grad], policy.inline_max_elements, policy.inline_max_flops)

    low, high = 1, 1 << 14
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def limits(runs: int) -> list[dict[str, Any]]:
    results = []
    for dtype in ("float32", "float64"):
        for name in [*NODES, "linear_64", "linear_96", "linear_128"]:
            rows = largest_inline(name, dtype)
            node, grad = _node_of(name, rows, dtype)
            times = []
            for _ in range(runs + 1):
                start = time.perf_counter()
                with ag.no_grad():
                    node.apply([grad])
                times.append(time.perf_counter() - start)
            times = times[1:]
            line = {
                "node": type(node).__name__,
                "case": name,
                "dtype": dtype,
                "rows": rows,
                "median_us": round(statistics.median(times) * 1e6, 1),
                "min_us": round(min(times) * 1e6, 1),
            }
            print(json.dumps(line))
            results.append(line)
    return results


async def heartbeat(passes: int) -> dict[str, float]:
    """Tick delays of a 1 ms heartbeat while GELU backward passes are awaited."""
    delays: list[float] = []
    running = True

    async def beat() -> None:
        last = time.perf_counter()
        while running:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            delays.append(now - last - 0.001)
            last = now

    x = ag.randn(128, 128, dtype="float64", requires_grad=True)
    loss = F.gelu(x).sum()
    await loss.backward(retain_graph=True)  # (warm: threads started, caches filled)
    ticker = asyncio.create_task(beat())
    await asyncio.sleep(0.005)
    delays.clear()
    walls = []
    for _ in range(passes):
        await asyncio.sleep(0.002)
        start = time.perf_counter()
        await loss.backward(retain_graph=True)
        walls.append(time.perf_counter() - start)
    running = False
    await ticker
    ordered = sorted(delays)
    return {
        "tick_max_ms": round(ordered[-1] * 1e3, 2),
        "tick_p99_ms": round(ordered[int(len(ordered) * 0.99)] * 1e3, 2),
        "ticks": len(ordered),
        "backward_median_ms": round(statistics.median(walls) * 1e3, 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heartbeat", action="store_true", help="the GELU heartbeat view")
    parser.add_argument("--runs", type=int, default=20, help="timed backward calls per node")
    parser.add_argument("--passes", type=int, default=60, help="backward passes (heartbeat)")
    args = parser.parse_args(argv)
    if args.heartbeat:
        print(json.dumps(asyncio.run(heartbeat(args.passes))))
        return
    results = limits(args.runs)
    print("| node | case | dtype | rows | median µs | min µs |")
    print("|---|---|---|---|---|---|")
    for line in sorted(results, key=lambda r: -r["min_us"]):
        print(
            f"| {line['node']} | {line['case']} | {line['dtype']} | {line['rows']} | "
            f"{line['median_us']} | {line['min_us']} |"
        )


if __name__ == "__main__":
    main()
