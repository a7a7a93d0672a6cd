"""The watchdog of a CPU executor: worker threads held by nodes that block.

A backward node that waits (on a lock, an event, I/O, a sleep) holds its worker thread for
as long as it waits. With every worker held so, every other backward pass of the process
waits too: the pool has as many workers as cores (2 on a 2-core machine). The watchdog
notices when the executor's queue has not moved for ``EnginePolicy.blocked_node_s`` while
every worker is busy, warns (``BlockedWorkerWarning``) naming the nodes that hold the
workers, and starts an extra worker that serves the queue until it is empty. Extra workers
do not count against the CPU budget (the held workers do, although a waiting thread leaves
its core idle); at most ``MAX_EXTRA_WORKERS`` run at once.

It reads the queue and the workers' stacks from its own thread, every quarter of the limit:
nothing is added to the nodes' path.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import warnings
import weakref
from typing import TYPE_CHECKING

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
    last_mark: int | None = None
    since = time.monotonic()
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
        elif now - since >= limit and executor.extra_workers < MAX_EXTRA_WORKERS:
            executor.start_extra_worker()
            # (After the worker: a warnings filter that turns it into an error must not
            # stop the watchdog, nor the help.)
            with contextlib.suppress(Exception):
                _report(executor, now - since, warned)
            since = now
        del executor
        time.sleep(interval)


def _report(executor: Executor, held_s: float, warned: weakref.WeakSet[Node]) -> None:
    nodes = [node for node in held_nodes(executor) if node not in warned]
    if not nodes:
        return
    warned.update(nodes)
    names = ", ".join(sorted({node.name() for node in nodes}))
    warnings.warn(
        f"aioautograd: every CPU worker has been busy for {held_s:.1f} s while backward "
        f"tasks wait; the workers are running {names}. A backward that blocks (a lock, an "
        "event, I/O, sleep) holds its worker thread and delays every other backward pass: "
        "make it `async def backward` and await instead. An extra worker was started "
        "(EnginePolicy.blocked_node_s sets this delay).",
        BlockedWorkerWarning,
        stacklevel=1,
    )


def held_nodes(executor: Executor) -> list[Node]:
    """The nodes the executor's threads are running now (read from their stacks)."""
    from aioautograd.engine.evaluate import process_task

    code = process_task.__code__
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
