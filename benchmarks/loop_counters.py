"""Counters of an event loop's iterations and of the tasks created on it (instrumentation of
the RPC benchmarks: one wrapper per process, read through ``COUNTS``)."""

from __future__ import annotations

import asyncio
from typing import Any

COUNTS = {"iterations": 0, "tasks": 0}


def count_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Count ``loop``'s iterations and the tasks created on it into ``COUNTS`` (asyncio's
    pure-Python loop: ``_run_once`` is wrapped)."""
    run_once = loop._run_once  # type: ignore[attr-defined]

    def counted() -> None:
        COUNTS["iterations"] += 1
        run_once()

    loop._run_once = counted  # type: ignore[attr-defined]

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        COUNTS["tasks"] += 1
        return asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(factory)
