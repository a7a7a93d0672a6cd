"""``GrpcOptions.keep_awake_s``: a helper process at the lowest CPU priority that keeps a
core from idling while its worker exchanges frames, and sleeps otherwise. Real processes;
the helper's state is read from ``/proc`` (running or runnable while held, blocked on its
pipe when idle), not from timings."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from aioautograd.distributed import rpc
from aioautograd.distributed.rpc import awake
from aioautograd.distributed.rpc.backends.grpc_local import LocalCall
from aioautograd.distributed.rpc.registry import name_of
from tests.distributed import remote_fns
from tests.distributed.conftest import check_pipeline_against_torch, in_fresh_context, start_world

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(not awake.supported(), reason="keep_awake_s needs Linux"),
]


def _state(pid: int) -> str | None:
    """The process's state letter (``R`` running/runnable, ``S`` sleeping, ``Z`` zombie),
    or ``None`` once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def _wait_for(predicate: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())


def _gone(pid: int) -> bool:
    return _state(pid) in (None, "Z")


def test_the_helper_spins_while_held_and_sleeps_when_idle() -> None:
    waker = awake.CoreWaker(0.05)
    pid = waker.process.pid
    try:
        assert _wait_for(lambda: os.sched_getscheduler(pid) == os.SCHED_IDLE)
        # Nothing stamped: it ends up blocked on its pipe ("S"), and stays there.
        assert _wait_for(lambda: _state(pid) == "S")
        time.sleep(0.2)
        assert _state(pid) == "S"
        # Stamped: it wakes and stays runnable while the stamps keep coming (it may wait for
        # a core, never for its pipe). Checked between stamps, well within the hold.
        states = []
        for _ in range(50):
            waker.stamp()
            time.sleep(0.005)
            states.append(_state(pid))
        assert states[-10:] == ["R"] * 10, states
        # The hold runs out: asleep again, and a stamp wakes it again.
        assert _wait_for(lambda: _state(pid) == "S")
        assert _wait_for(lambda: (waker.stamp(), _state(pid) == "R")[1])
    finally:
        waker.close()
    assert waker.process.returncode == 0
    waker.stamp()  # after close: does nothing
    waker.close()  # twice: does nothing


def test_the_helper_exits_with_its_worker() -> None:
    # A process that starts a helper, keeps it spinning, and is killed: the helper must not
    # outlive it (its pipe closes with the process).
    code = (
        "import sys, time\n"
        "from aioautograd.distributed.rpc.awake import CoreWaker\n"
        "w = CoreWaker(0.05)\n"
        "print(w.process.pid, flush=True)\n"
        "while True:\n"
        "    w.stamp()\n"
        "    time.sleep(0.001)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env) as owner:
        try:
            assert owner.stdout is not None
            helper = int(owner.stdout.readline())
            assert _state(helper) not in (None, "Z")
            owner.send_signal(signal.SIGKILL)
            owner.wait(10)
            assert _wait_for(lambda: _gone(helper)), _state(helper)
        finally:
            owner.kill()


def test_a_bad_hold_is_refused() -> None:
    for hold in (0, -1.0, math.nan):
        with pytest.raises(ValueError, match="must be positive"):
            awake.CoreWaker(hold)


def test_keep_awake_s_is_off_by_default_and_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AIOAUTOGRAD_KEEP_AWAKE_S", raising=False)
    assert rpc.GrpcOptions(master_port=1, token="t").resolved().keep_awake_s == 0.0
    monkeypatch.setenv("AIOAUTOGRAD_KEEP_AWAKE_S", "0.02")
    assert rpc.GrpcOptions(master_port=1, token="t").resolved().keep_awake_s == 0.02
    given = rpc.GrpcOptions(master_port=1, token="t", keep_awake_s=0.0)
    assert given.resolved().keep_awake_s == 0.0  # an explicit value wins
    monkeypatch.setenv("AIOAUTOGRAD_KEEP_AWAKE_S", "soon")
    with pytest.raises(ValueError, match="AIOAUTOGRAD_KEEP_AWAKE_S must be a number"):
        rpc.GrpcOptions(master_port=1, token="t").resolved()
    monkeypatch.delenv("AIOAUTOGRAD_KEEP_AWAKE_S")
    for bad in (-0.01, math.inf, math.nan):
        with pytest.raises(ValueError, match="keep_awake_s must be a finite number"):
            rpc.GrpcOptions(master_port=1, token="t", keep_awake_s=bad).resolved()


async def test_workers_keep_a_core_awake_and_stop_with_the_world(tmp_path: Path) -> None:
    await in_fresh_context(lambda: _test_world(tmp_path))


async def _test_world(tmp_path: Path) -> None:
    world = await start_world("grpc", tmp_path, n_workers=2, grpc_options={"keep_awake_s": 0.02})
    try:
        driver: Any = world.driver
        helpers = [driver._core_waker.process.pid]
        for worker in ("worker1", "worker2"):
            state = await rpc.rpc_async(worker, remote_fns.core_waker)
            assert state["pid"] is not None, state
            assert state["idle_policy"], state
            helpers.append(state["pid"])
        assert len(set(helpers)) == 3
        assert isinstance(driver._streams["worker1"]._call, LocalCall)
        # The calls and a distributed backward are those of a world without it.
        await check_pipeline_against_torch(3)
        assert await rpc.rpc_async("worker2", remote_fns.add, args=(2, 3)) == 5
        # Idle: the driver's helper sleeps on its pipe.
        assert _wait_for(lambda: _state(helpers[0]) == "S")
        assert await world.close() == {"worker1": 0, "worker2": 0}
        assert driver._core_waker.process.returncode == 0
        for pid in helpers[1:]:
            assert _wait_for(lambda pid=pid: _gone(pid)), (pid, _state(pid))
    finally:
        world.kill_all()


async def test_off_starts_no_helper(tmp_path: Path) -> None:
    await in_fresh_context(lambda: _test_off(tmp_path))


async def _test_off(tmp_path: Path) -> None:
    world = await start_world("grpc", tmp_path, n_workers=1)
    try:
        driver: Any = world.driver
        assert driver._core_waker is None
        assert driver.activity is None
        assert await rpc.rpc_async("worker1", remote_fns.core_waker) == {"pid": None}
        assert await world.close() == {"worker1": 0}
    finally:
        world.kill_all()


async def test_uvloop_workers_keep_a_core_awake(tmp_path: Path) -> None:
    pytest.importorskip("uvloop")
    await in_fresh_context(lambda: _test_uvloop(tmp_path))


async def _test_uvloop(tmp_path: Path) -> None:
    # The helper does not depend on the event loop: uvloop workers start and stop theirs.
    world = await start_world(
        "grpc", tmp_path, n_workers=2, grpc_options={"keep_awake_s": 0.02}, uvloop=True
    )
    try:
        states = [await rpc.rpc_async(w, remote_fns.core_waker) for w in ("worker1", "worker2")]
        for state in states:
            assert state["pid"] is not None, state
            assert state["idle_policy"], state
        relayed = await rpc.rpc_async(
            "worker1", remote_fns.relay, args=("worker2", name_of(remote_fns.whoami))
        )
        assert relayed == "worker2"
        assert await world.close() == {"worker1": 0, "worker2": 0}
        for state in states:
            assert _wait_for(lambda pid=state["pid"]: _gone(pid)), state
    finally:
        world.kill_all()
