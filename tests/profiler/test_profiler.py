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
