"""Exports of profiler events: Chrome trace JSON and a matplotlib timeline."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aioautograd.profiler.recorder import NodeEvent


def to_chrome_trace(events: Sequence[NodeEvent]) -> dict[str, Any]:
    """Events in the Chrome trace event format (complete events, one thread per lane)."""
    threads = sorted({event.thread for event in events})
    tids = {name: i for i, name in enumerate(threads)}
    origin = min((event.start_ns for event in events), default=0)
    trace: list[dict[str, Any]] = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}}
        for name, tid in tids.items()
    ]
    for event in events:
        trace.append(
            {
                "name": event.name,
                "cat": f"graph_task_{event.graph_task}",
                "ph": "X",
                "pid": 0,
                "tid": tids[event.thread],
                "ts": (event.start_ns - origin) / 1e3,
                "dur": (event.end_ns - event.start_ns) / 1e3,
                "args": {
                    "graph_task": event.graph_task,
                    "device": event.device,
                    "sequence_nr": event.sequence_nr,
                },
            }
        )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def plot_timeline(
    events: Sequence[NodeEvent], path: str | None = None, title: str = "aioautograd engine"
) -> Any:
    """A timeline figure: one lane per executor thread, one colour per graph task.

    Saves a PNG to ``path`` when given; returns the matplotlib figure.

    Raises:
        RuntimeError: when matplotlib is not installed (``pip install aioautograd[viz]``).
    """
    try:
        import matplotlib

        if path is not None:
            matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(
            "plot_timeline needs matplotlib: pip install 'aioautograd[viz]'"
        ) from exc
    threads = sorted({event.thread for event in events})
    lanes = {name: i for i, name in enumerate(threads)}
    tasks = sorted({event.graph_task for event in events})
    colors = plt.get_cmap("tab20")
    origin = min((event.start_ns for event in events), default=0)
    figure, axes = plt.subplots(figsize=(12, 1 + 0.6 * max(1, len(threads))))
    for event in events:
        axes.broken_barh(
            [((event.start_ns - origin) / 1e6, max((event.end_ns - event.start_ns) / 1e6, 1e-3))],
            (lanes[event.thread] - 0.4, 0.8),
            facecolors=colors(tasks.index(event.graph_task) % 20),
        )
    axes.set_yticks(range(len(threads)), threads)
    axes.set_xlabel("time (ms)")
    axes.set_title(f"{title}: {len(events)} nodes, {len(tasks)} graph tasks")
    figure.tight_layout()
    if path is not None:
        figure.savefig(path, dpi=100)
        plt.close(figure)
    return figure
