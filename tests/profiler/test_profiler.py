"""The engine profiler: events, Chrome trace, timeline."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest

import aioautograd as ag
from aioautograd.profiler import profile


async def test_profiler_records_every_node_of_every_graph_task(tmp_path: Path) -> None:
    ws = [ag.randn(8, 8, requires_grad=True) for _ in range(3)]
    x = ag.randn(4, 8)
    with profile() as prof:
        await asyncio.gather(*(((x @ w).exp() * 2).sum().backward() for w in ws))
    names = [event.name for event in prof.events]
    assert names.count("MatMulBackward0") == 3
    assert names.count("AccumulateGrad") == 3
    assert len({event.graph_task for event in prof.events}) == 3
    assert all(event.device == "cpu" for event in prof.events)
    # Small CPU nodes run inline on the loop's thread (engine/inline.py), others on executors.
    loop_thread = threading.current_thread().name
    assert all(
        event.thread == loop_thread or event.thread.startswith("aioautograd-cpu")
        for event in prof.events
    )
    assert all(event.end_ns >= event.start_ns for event in prof.events)
    assert prof.summary()["MatMulBackward0"][0] == 3

    trace_path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace_path))
    trace = json.loads(trace_path.read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(prof.events)
    assert {e["args"]["graph_task"] for e in complete} == {e.graph_task for e in prof.events}


async def test_backward_outside_the_block_is_not_recorded() -> None:
    x = ag.randn(3, requires_grad=True)
    with profile() as prof:
        pass
    await (x * 2).sum().backward()
    assert prof.events == []


async def test_timeline_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    x = ag.randn(3, requires_grad=True)
    with profile() as prof:
        await (x.exp() * 2).sum().backward()
    path = tmp_path / "timeline.png"
    prof.plot_timeline(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_record_function_labels_follow_each_models_passes(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from aioautograd.profiler import record_function

    ws = {name: ag.randn(16, 16, requires_grad=True) for name in ("adam", "sgd")}

    def step(w: ag.Tensor) -> None:
        (w.exp() * 2).sum().backward_sync()

    async def train(name: str) -> None:
        with record_function(name):
            await (ws[name] * 3).sum().backward()  # awaited on the loop
            await ag.offload(step, ws[name])  # in an offloaded step: the label follows

    with profile() as prof:
        await asyncio.gather(train("adam"), train("sgd"))
    await (ws["adam"] * 1).sum().backward()  # outside the profiler: not recorded
    by_label: dict[str | None, set[int]] = {}
    for event in prof.events:
        by_label.setdefault(event.label, set()).add(event.graph_task)
    assert set(by_label) == {"adam", "sgd"}
    assert all(len(tasks) == 2 for tasks in by_label.values())
    figure = prof.plot_timeline(str(tmp_path / "timeline.png"), zoom_ms=(0.0, 1.0))
    legend = figure.axes[0].get_legend()
    assert sorted(text.get_text() for text in legend.get_texts()) == ["adam", "sgd"]
    assert len(figure.axes) == 2
    assert figure.axes[1].get_xlim() == (0.0, 1.0)
    # Every node is one bar in each panel, in its label's colour (one collection per lane
    # and label, not one per node: thousands of nodes stay fast to draw).
    for axes in figure.axes:
        assert sum(len(c.get_paths()) for c in axes.collections) == len(prof.events)
        assert len(axes.collections) <= 2 * len({e.thread for e in prof.events})
