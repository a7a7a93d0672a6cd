"""`profile`: a context manager that records every node the engine evaluates.

The recorder is captured by each graph task when it starts (from a ``ContextVar``, so only
backward passes started inside the ``with`` block of this task are recorded). Recording
costs two clock reads and one list append per node; without a profiler the engine pays one
attribute check.
"""

from __future__ import annotations

import threading
import time
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any

active_profiler: ContextVar[profile | None] = ContextVar("active_profiler", default=None)
current_label: ContextVar[str | None] = ContextVar("profiler_label", default=None)


@dataclass(frozen=True, slots=True)
class NodeEvent:
    """One evaluation of one node."""

    name: str
    graph_task: int
    device: str
    thread: str
    start_ns: int
    end_ns: int
    sequence_nr: int
    label: str | None = None  # the ``record_function`` around the backward pass, if any

    @property
    def duration_us(self) -> float:
        return (self.end_ns - self.start_ns) / 1e3


class profile:
    """Record the engine's node evaluations inside the block.

    Example::

        with aioautograd.profiler.profile() as prof:
            await asyncio.gather(*(step(m) for m in models))
        prof.export_chrome_trace("trace.json")     # open in ui.perfetto.dev
        prof.plot_timeline("timeline.png")
    """

    def __init__(self) -> None:
        self.events: list[NodeEvent] = []
        self._token: Token[profile | None] | None = None
        self.start_ns = 0
        self.end_ns = 0

    def __enter__(self) -> profile:
        self.start_ns = time.perf_counter_ns()
        self._token = active_profiler.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None
        active_profiler.reset(self._token)
        self.end_ns = time.perf_counter_ns()

    def record(
        self, node: Any, graph_task_id: int, device: Any, start_ns: int, label: str | None = None
    ) -> None:
        """Called by the engine after a node ran (executor thread, or the loop's inline)."""
        self.events.append(
            NodeEvent(
                node.name(),
                graph_task_id,
                str(device),
                threading.current_thread().name,
                start_ns,
                time.perf_counter_ns(),
                node.sequence_nr,
                label,
            )
        )

    def export_chrome_trace(self, path: str) -> None:
        """Write the events as Chrome trace JSON (chrome://tracing, ui.perfetto.dev)."""
        import json

        from aioautograd.profiler.trace import to_chrome_trace

        with open(path, "w") as file:
            json.dump(to_chrome_trace(self.events), file)

    def plot_timeline(
        self,
        path: str | None = None,
        title: str = "aioautograd engine",
        zoom_ms: tuple[float, float] | None = None,
    ) -> Any:
        """Draw one lane per thread, one colour per ``record_function`` label (or per graph
        task without labels), with a zoomed panel of ``zoom_ms`` (matplotlib)."""
        from aioautograd.profiler.trace import plot_timeline

        return plot_timeline(self.events, path, title, zoom_ms)

    def summary(self) -> dict[str, tuple[int, float]]:
        """Node name → (count, total microseconds), most expensive first."""
        totals: dict[str, tuple[int, float]] = {}
        for event in self.events:
            count, total = totals.get(event.name, (0, 0.0))
            totals[event.name] = (count + 1, total + event.duration_us)
        return dict(sorted(totals.items(), key=lambda item: -item[1][1]))


class record_function:
    """Label the backward passes started inside the block, in the profiler's events, trace
    and timeline (PyTorch's ``record_function`` names a region the same way).

    The label is a context variable: it follows ``offload`` calls and stays with the task
    that set it. Example::

        async def train(name, model):
            with aioautograd.profiler.record_function(name):
                ...  # every backward pass here is drawn in this model's colour
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._token: Token[str | None] | None = None

    def __enter__(self) -> record_function:
        self._token = current_label.set(self.name)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None
        current_label.reset(self._token)
