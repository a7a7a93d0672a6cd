"""Multi-device scheduling and the stream/event protocol, on the simulated backend."""

from __future__ import annotations

import numpy as np
import pytest

import aioautograd as ag
from aioautograd.devices import current_stream, new_stream, stream
from aioautograd.devices.simulated import LOG, SimOp
from aioautograd.profiler import profile
from tests.helpers import assert_close


@pytest.fixture(autouse=True)
def _clear_log() -> None:
    LOG.clear()


def test_sim_devices_parse_and_validate() -> None:
    assert str(ag.device("sim:2")) == "sim:2"
    assert ag.device("sim") is ag.device("sim:0")
    with pytest.raises(RuntimeError, match="the simulated backend has 4 devices"):
        ag.device("sim:9")


def test_cross_device_ops_are_refused() -> None:
    a = ag.randn(2, device="sim:0")
    b = ag.randn(2, device="sim:1")
    with pytest.raises(RuntimeError, match="same device"):
        _ = a + b


@pytest.mark.usefixtures("executors_only")
async def test_each_node_runs_on_the_executor_of_its_device() -> None:
    x = ag.randn(3, dtype="float64", device="sim:0", requires_grad=True)
    w = ag.randn(3, dtype="float64", requires_grad=True)  # cpu
    h0 = x.exp()  # sim:0
    h1 = h0.to("sim:1") * 2  # sim:1
    h2 = h1.to("cpu") * w  # cpu
    with profile() as prof:
        await h2.sum().backward()
    by_name = {(e.name, e.device): e.thread for e in prof.events}
    assert by_name[("MulBackward0", "cpu")].startswith("aioautograd-cpu")
    # ToDevice(sim:1 -> cpu) receives a cpu gradient: runs on cpu; the sim:1 multiply on sim:1.
    sim1_threads = {e.thread for e in prof.events if e.device == "sim:1"}
    sim0_threads = {e.thread for e in prof.events if e.device == "sim:0"}
    assert sim1_threads == {"aioautograd-sim:1-0"}
    assert sim0_threads == {"aioautograd-sim:0-0"}
    assert {e.name for e in prof.events if e.device == "sim:0"} >= {"ExpBackward0"}
    expected_x = 2 * w.data * np.exp(x.data)
    assert_close(x.grad, expected_x)
    assert x.grad.device is ag.device("sim:0")
    assert_close(w.grad, 2 * np.exp(x.data))


async def test_cross_device_gradients_accumulate() -> None:
    x = ag.randn(4, dtype="float64", device="sim:0", requires_grad=True)
    on_sim1 = x.to("sim:1")
    on_cpu = x.to("cpu")
    loss = (on_sim1 * 3).sum().to("cpu") + (on_cpu * 5).sum() + (x * 7).sum().to("cpu")
    await loss.backward()
    assert_close(x.grad, np.full(4, 15.0))
    assert x.grad.device is ag.device("sim:0")


def _index(ops: list[SimOp], kind: str, **match: object) -> int:
    for i, op in enumerate(ops):
        if op.kind == kind and all(getattr(op, k) == v for k, v in match.items()):
            return i
    raise AssertionError(f"no {kind} op matching {match} in {ops}")


async def test_consumers_wait_on_producer_events_before_use() -> None:
    device = ag.device("sim:2")
    s1, s2 = new_stream(device), new_stream(device)
    x = ag.randn(3, dtype="float64", device=device, requires_grad=True)
    with stream(s1):
        a = x * 2  # MulBackward0 runs on s1
    with stream(s2):
        b = x.exp()  # ExpBackward0 runs on s2
    c = a + b  # AddBackward0 on the default stream
    assert a.grad_fn.stream is s1
    assert b.grad_fn.stream is s2
    default = current_stream(device)
    assert c.grad_fn.stream is default
    LOG.clear()
    await c.sum().backward()
    ops = LOG.snapshot()
    # Every consumer on another stream waited on an event its producer recorded, before
    # its own use of the stream.
    for consumer in (s1, s2):
        waits = [op for op in ops if op.kind == "wait" and op.stream == consumer.name]
        assert waits, f"{consumer.name} never waited"
        for wait in waits:
            record = _index(ops, "record", event=wait.event)
            wait_at = ops.index(wait)
            assert record < wait_at
            assert ops[record].stream != consumer.name
        first_use = _index(ops, "use", stream=consumer.name)
        assert min(ops.index(w) for w in waits) < first_use
    assert_close(x.grad, 2 + np.exp(x.data))


async def test_leaf_streams_are_joined_to_the_caller_stream() -> None:
    device = ag.device("sim:3")
    side = new_stream(device)
    with stream(side):
        x = ag.randn(3, dtype="float64", device=device, requires_grad=True)
        y = (x * x).sum()  # the accumulator of x is created on the side stream
    caller = current_stream(device)
    LOG.clear()
    await y.backward()
    ops = LOG.snapshot()
    # The caller's stream waits on an event recorded on the leaf's stream, and the graph
    # task waits for a completion event recorded on the caller's stream.
    leaf_record = max(
        i for i, op in enumerate(ops) if op.kind == "record" and op.stream == side.name
    )
    join = _index(ops, "wait", stream=caller.name, event=ops[leaf_record].event)
    completion = [i for i, op in enumerate(ops) if op.kind == "sync" and op.stream == caller.name]
    assert completion
    assert completion[-1] > join
    assert_close(x.grad, 2 * x.data)


async def test_root_node_waits_for_the_callers_stream() -> None:
    device = ag.device("sim:0")
    work = new_stream(device)
    x = ag.randn(2, dtype="float64", device=device, requires_grad=True)
    with stream(work):
        y = (x * 3).sum()
    LOG.clear()
    await y.backward()
    ops = LOG.snapshot()
    caller = current_stream(device)
    first_wait = _index(ops, "wait", stream=work.name)
    assert ops[_index(ops, "record", event=ops[first_wait].event)].stream == caller.name
    assert first_wait < _index(ops, "use", stream=work.name)


async def test_backward_on_sim_matches_cpu(device: str) -> None:
    data = np.random.default_rng(5).standard_normal((4, 3))
    results = []
    for dev in ("cpu", device):
        w = ag.tensor(data, device=dev, requires_grad=True)
        loss = (w.tanh() @ w.T).logsumexp(dim=1).sum()
        await loss.backward()
        results.append(w.grad.cpu().numpy())
    assert_close(results[0], results[1])
