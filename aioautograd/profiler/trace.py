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
                    "label": event.label,
                    "graph_task": event.graph_task,
                    "device": event.device,
                    "sequence_nr": event.sequence_nr,
                },
            }
        )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def plot_timeline(
    events: Sequence[NodeEvent],
    path: str | None = None,
    title: str = "aioautograd engine",
    zoom_ms: tuple[float, float] | None = None,
) -> Any:
    """A timeline figure: one lane per thread that ran nodes, one colour per
    ``record_function`` label (per graph task when no event has one), with a legend.

    ``zoom_ms=(start, end)`` adds a second panel showing that window (milliseconds from the
    first event), where single nodes can be told apart. Saves a PNG to ``path`` when given;
    returns the matplotlib figure.

    Raises:
        RuntimeError: when matplotlib is not installed (``pip install aioautograd[viz]``).
    """
    try:
        import matplotlib

        if path is not None:
            matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise RuntimeError(
            "plot_timeline needs matplotlib: pip install 'aioautograd[viz]'"
        ) from exc
    threads = sorted({event.thread for event in events})
    lanes = {name: i for i, name in enumerate(threads)}
    labelled = any(event.label is not None for event in events)

    def key(event: NodeEvent) -> str:
        if labelled:
            return event.label or "(no label)"
        return f"graph task {event.graph_task}"

    keys = sorted({key(event) for event in events})
    colors = plt.get_cmap("tab10" if len(keys) <= 10 else "tab20")
    color_of = {k: colors(i % colors.N) for i, k in enumerate(keys)}
    origin = min((event.start_ns for event in events), default=0)
    panels = 2 if zoom_ms is not None else 1
    height = 1 + 0.6 * max(1, len(threads))
    figure, axes_list = plt.subplots(panels, 1, figsize=(12, height * panels), squeeze=False)
    # One collection per lane and colour: one per event took minutes for a few thousand.
    spans: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for event in events:
        start = (event.start_ns - origin) / 1e6
        width = max((event.end_ns - event.start_ns) / 1e6, 1e-3)
        spans.setdefault((lanes[event.thread], key(event)), []).append((start, width))
    for panel, axes in enumerate(axes_list[:, 0]):
        for (lane, group), bars in spans.items():
            axes.broken_barh(bars, (lane - 0.4, 0.8), facecolors=color_of[group])
        axes.set_yticks(range(len(threads)), threads)
        axes.set_xlabel("time (ms)")
        if panel == 1 and zoom_ms is not None:
            axes.set_xlim(*zoom_ms)
            axes.set_title(f"zoom: {zoom_ms[0]:g}-{zoom_ms[1]:g} ms")
        else:
            graph_tasks = len({event.graph_task for event in events})
            axes.set_title(f"{title}: {len(events)} nodes, {graph_tasks} graph tasks")
    if len(keys) <= 20:
        handles = [Patch(color=color_of[k], label=k) for k in keys]
        axes_list[0, 0].legend(
            handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small"
        )
    figure.tight_layout()
    if path is not None:
        figure.savefig(path, dpi=100)
        plt.close(figure)
    return figure
