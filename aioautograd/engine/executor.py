"""Per-device executors: worker threads that drain a `ReadyQueue` (PyTorch's ``thread_main``).

Workers evaluate nodes *and* do the dependency bookkeeping themselves, so the event loop is
never round-tripped per node. A worker that finishes a node whose successor is ready on the
same device runs it directly when nothing of higher priority waits in the queue, which keeps
a chain of nodes on one thread without queue traffic.

Reentrant backward: a node running on a worker may call ``backward_sync``; the worker then
serves its own queue until that nested graph task completes (``drive``), as ``thread_main``
recursion does. Past ``MAX_DEPTH`` nested levels on one thread, the nested graph task is
driven by a fresh thread instead, so depth is bounded by neither deadlock nor stack size.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import TYPE_CHECKING

import numpy

from aioautograd.engine.ready_queue import ReadyQueue

if TYPE_CHECKING:
    from aioautograd.devices.device import Device
    from aioautograd.engine.engine import Engine
    from aioautograd.engine.graph_task import GraphTask
    from aioautograd.engine.ready_queue import NodeTask

MAX_DEPTH = 60
# A worker running small nodes back to back sleeps GIL_PAUSE_S after holding the GIL for
# about GIL_HOLD_S (checked every 32 nodes), so that the event loop waits about that long
# at most instead of CPython's 5 ms switch interval.
GIL_HOLD_S = 0.002
GIL_PAUSE_S = 0.00002


class _WorkerState(threading.local):
    """Which executor the current thread works for and how deep its reentrant recursion is.

    This is a property of the *thread* (as PyTorch's ``worker_device``), not of a task.
    """

    executor: Executor | None = None
    depth: int = 0
    evaluated: int = 0  # nodes this thread has evaluated
    pause_at: float = 0.0  # when it next lets other threads take the GIL


worker_state = _WorkerState()


class Executor:
    """Worker threads serving the ready queue of one device."""

    def __init__(self, engine: Engine, device: Device, num_threads: int) -> None:
        self.engine = engine
        self.device = device
        self.num_threads = num_threads
        self.queue = ReadyQueue()
        self._threads: list[threading.Thread] = []
        self._start_lock = threading.Lock()
        self._busy_lock = threading.Lock()
        self.busy = 0  # threads currently running a task (for observability and tests)

    def push(self, task: NodeTask, wake: bool = True) -> None:
        if len(self._threads) < self.num_threads:
            self._start()
        self.queue.push(task, wake)

    def _start(self) -> None:
        with self._start_lock:
            while len(self._threads) < self.num_threads:
                thread = threading.Thread(
                    target=self._thread_main,
                    name=f"aioautograd-{self.device}-{len(self._threads)}",
                    daemon=True,
                )
                self._threads.append(thread)
                thread.start()

    def _thread_main(self) -> None:
        worker_state.executor = self
        worker_state.depth = 0
        if self.device.type == "cpu":
            lower_priority(self.engine.worker_nice)
        # Backward formulas evaluate masked-out branches (pow at 0, log of a clamped value):
        # like PyTorch, produce inf/nan silently instead of NumPy warnings on this thread.
        numpy.seterr(all="ignore")
        while True:
            # No local reference survives the call: an idle worker must not keep the last
            # graph (and its buffers) alive until its next task.
            self.run(self._next_task())

    def _next_task(self) -> NodeTask | None:
        started = time.perf_counter()
        task = self.queue.pop()
        now = time.perf_counter()
        if now - started > GIL_HOLD_S / 4:  # it slept (without the GIL): a fresh hold starts
            worker_state.pause_at = now + GIL_HOLD_S
        return task

    def run(self, task: NodeTask | None) -> None:
        """Evaluate ``task`` and the chain of same-device successors it makes ready."""
        from aioautograd.engine.evaluate import evaluate_task

        engine = self.engine
        with self._busy_lock:
            self.busy += 1
        state = worker_state
        try:
            while task is not None:
                task = evaluate_task(engine, task, self)
                state.evaluated += 1
                if not state.evaluated & 31:
                    pause_if_due()
        finally:
            with self._busy_lock:
                self.busy -= 1

    def drive(self, graph_task: GraphTask) -> None:
        """Serve this executor's queue on the current thread until ``graph_task`` completes.

        Called by a worker thread that started a nested (reentrant) graph task.
        """
        if worker_state.depth >= MAX_DEPTH:
            self._drive_on_fresh_thread(graph_task)
            return
        worker_state.depth += 1
        graph_task.owner_queue = self.queue
        try:

            def completed() -> bool:
                return graph_task.completed

            while not graph_task.completed:
                self.run(self.queue.pop(completed))
        finally:
            worker_state.depth -= 1

    def _drive_on_fresh_thread(self, graph_task: GraphTask) -> None:
        def main() -> None:
            worker_state.executor = self
            worker_state.depth = 0
            if self.device.type == "cpu":
                lower_priority(self.engine.worker_nice)
            self.drive(graph_task)

        thread = threading.Thread(
            target=main, name=f"aioautograd-{self.device}-reentrant", daemon=True
        )
        thread.start()
        graph_task.wait_completed()
        thread.join()


def lower_priority(nice: int) -> None:
    """Raise the calling thread's nice value by ``nice`` (Linux, where it is per thread).

    CPU workers run below the event loop's thread: when the loop's thread wakes while a
    backward keeps every core busy (the worker plus BLAS's own threads), the scheduler gives
    it a core at once instead of after a time slice.
    """
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):  # e.g. a sandbox that forbids it: stay as we are
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


def pause_if_due() -> None:
    """On a worker that has held the GIL for about ``GIL_HOLD_S``, sleep ``GIL_PAUSE_S``.

    Many small nodes in a row (or a long graph walk) hold the GIL between NumPy calls that
    never release it: a thread waiting for it, the event loop's, would get it only after
    CPython's switch interval (5 ms). A short sleep lets it in now.
    """
    state = worker_state
    if state.executor is None:
        return
    if time.perf_counter() > state.pause_at:
        time.sleep(GIL_PAUSE_S)
        state.pause_at = time.perf_counter() + GIL_HOLD_S
