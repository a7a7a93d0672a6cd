"""The watchdog of a CPU executor: worker threads held by nodes that block.

A backward node that waits (on a lock, an event, I/O, a sleep) holds its worker thread for
as long as it waits. With every worker held so, every other backward pass of the process
waits too: the pool has as many workers as cores (2 on a 2-core machine). The watchdog
notices when the executor's queue has not moved for ``EnginePolicy.blocked_node_s`` while
every worker is busy, and warns (``BlockedWorkerWarning``) naming the nodes that hold the
workers. Unless every held worker wanted a core meanwhile (long nodes that compute: another
thread would only oversubscribe the cores), it also starts an extra worker that serves the
queue until it is empty. Extra workers do not count against the CPU budget (the held
workers do, although a waiting thread leaves its core idle); at most ``MAX_EXTRA_WORKERS``
run at once.

It reads the queue and the workers' stacks from its own thread, every quarter of the limit:
nothing is added to the nodes' path.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import warnings
import weakref
from typing import TYPE_CHECKING

from aioautograd.devices.gil_waiters import forget_engine_thread, register_engine_thread

if TYPE_CHECKING:
    from types import FrameType

    from aioautograd.autograd.node import Node
    from aioautograd.engine.executor import Executor

MAX_EXTRA_WORKERS = 8


class BlockedWorkerWarning(RuntimeWarning):
    """Every worker of the CPU executor has been held by the same nodes for a while."""


def watch(executor: Executor) -> None:
    """Start the watchdog thread of ``executor`` (it ends with the executor)."""
    thread = threading.Thread(
        target=_main, args=(weakref.ref(executor),), name="aioautograd-watchdog", daemon=True
    )
    thread.start()


def _main(executor_ref: weakref.ref[Executor]) -> None:
    register_engine_thread()  # its sleeps never ask a worker to pause
    try:
        _watch(executor_ref)
    finally:
        forget_engine_thread()


def _watch(executor_ref: weakref.ref[Executor]) -> None:
    last_mark: int | None = None
    since = time.monotonic()
    demand: list[int | None] = []
    warned: weakref.WeakSet[Node] = weakref.WeakSet()
    while True:
        executor = executor_ref()
        if executor is None or executor.closed:
            return
        limit = executor.engine.policy.blocked_node_s
        interval = min(0.25, max(0.01, limit / 4)) if limit > 0 else 0.25
        now = time.monotonic()
        mark = executor.queue.head_mark()
        if limit <= 0 or mark is None or executor.busy < executor.workers:
            last_mark = None
        elif mark != last_mark:
            last_mark, since = mark, now
            demand = [cpu_demand_ns(thread) for thread in executor.threads()]
        elif now - since >= limit and executor.extra_workers < MAX_EXTRA_WORKERS:
            # No node held (workers waiting for a core between two nodes): the budget's
            # business, not ours.
            nodes = held_nodes(executor)
            if nodes:
                computing = _all_computing(executor, demand, now - since)
                # Warn first: once started, the extra worker may finish the waiting passes
                # before this thread gets the GIL back, and a warning emitted after them
                # would name a wait that is over. (Suppressed: a warnings filter that turns
                # it into an error must not stop the watchdog, nor the help.)
                with contextlib.suppress(Exception):
                    _report(nodes, now - since, warned, computing)
                if not computing:
                    executor.start_extra_worker()
            del nodes  # not kept alive while the watchdog sleeps
            since = now
            demand = [cpu_demand_ns(thread) for thread in executor.threads()]
        del executor
        time.sleep(interval)


def _all_computing(executor: Executor, before: list[int | None], held_s: float) -> bool:
    """Whether every worker wanted a core over the last ``held_s``, running or waiting in
    the kernel's run queue for at least 5% of it (a thread that waits on a lock, an event or
    I/O does neither): long nodes that compute, for which another thread would only
    oversubscribe the cores. A worker kept off the cores by other processes still counts:
    it is computing, and another thread would wait for the same cores. False where the
    kernel does not say (no ``/proc``)."""
    threads = executor.threads()
    if len(threads) != len(before):
        return False
    for thread, start in zip(threads, before, strict=True):
        end = cpu_demand_ns(thread)
        if start is None or end is None or (end - start) < 0.05 * held_s * 1e9:
            return False
    return True


def cpu_demand_ns(thread: threading.Thread) -> int | None:
    """The time ``thread`` has spent on a core or runnable in the run queue, in ns (Linux),
    or ``None``. From ``schedstat`` where the kernel keeps it; else the CPU time alone, in
    clock ticks (10 ms steps)."""
    task = f"/proc/self/task/{thread.native_id}"
    with contextlib.suppress(OSError, ValueError), open(f"{task}/schedstat", "rb") as stat:
        on_cpu, waiting = stat.read().split()[:2]
        return int(on_cpu) + int(waiting)
    try:
        with open(f"{task}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, ValueError, IndexError):
        return None
    return None if _CLOCK_TICKS is None else ticks * 1_000_000_000 // _CLOCK_TICKS


def _clock_ticks() -> int | None:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):
        return None


_CLOCK_TICKS = _clock_ticks()


def _report(
    held: list[Node], held_s: float, warned: weakref.WeakSet[Node], computing: bool
) -> None:
    nodes = [node for node in held if node not in warned]
    if not nodes:
        return
    warned.update(nodes)
    names = ", ".join(sorted({node.name() for node in nodes}))
    if computing:
        advice = (
            "They are computing: the cores are busy, and other passes wait their turn. "
            "Split long backward nodes if other passes must not wait this long."
        )
    else:
        advice = (
            "A backward that blocks (a lock, an event, I/O, sleep) holds its worker thread "
            "and delays every other backward pass: make it `async def backward` and await "
            "instead. An extra worker is started to serve the other passes."
        )
    warnings.warn(
        f"aioautograd: every CPU worker has been busy for {held_s:.1f} s while backward "
        f"tasks wait; the workers are running {names}. {advice} "
        "(EnginePolicy.blocked_node_s sets this delay.)",
        BlockedWorkerWarning,
        stacklevel=1,
    )


def held_nodes(executor: Executor) -> list[Node]:
    """The nodes the executor's threads are running now (read from their stacks)."""
    from aioautograd.engine.evaluate import evaluate_function

    code = evaluate_function.__code__
    idents = {thread.ident for thread in executor.threads()}
    nodes: list[Node] = []
    for ident, frame in sys._current_frames().items():
        if ident not in idents:
            continue
        current: FrameType | None = frame
        while current is not None:
            if current.f_code is code:
                node = current.f_locals.get("node")
                if node is not None:
                    nodes.append(node)
                break
            current = current.f_back
    return nodes
