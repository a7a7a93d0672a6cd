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

import asyncio
import contextlib
import contextvars
import heapq
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy

from aioautograd.devices.cpu_budget import CpuBudget, cpu_budget
from aioautograd.devices.gil_waiters import (
    forget_engine_thread,
    others_may_wait,
    register_engine_thread,
)
from aioautograd.devices.thread_slice import drop_inherited_slice
from aioautograd.engine.policy import NUMPY_ERRORS, RESTED_S, SLEPT_FRACTION_OF_HOLD
from aioautograd.engine.ready_queue import TIE_BITS, ReadyQueue
from aioautograd.engine.watchdog import watch

if TYPE_CHECKING:
    from aioautograd.devices.device import Device
    from aioautograd.engine.engine import Engine
    from aioautograd.engine.graph_task import GraphTask
    from aioautograd.engine.ready_queue import NodeTask

MAX_DEPTH = 60


class _WorkerState(threading.local):
    """Which executor the current thread works for and how deep its reentrant recursion is.

    This is a property of the *thread* (as PyTorch's ``worker_device``), not of a task.
    """

    executor: Executor | None = None
    depth: int = 0
    extra: bool = False  # an extra worker started by the watchdog (not budgeted)
    pause_at: float = 0.0  # when it next lets other threads take the GIL


worker_state = _WorkerState()

_STOP: Any = object()  # queued by ``Executor.close``: the worker that pops it exits


class Executor:
    """Worker threads serving the ready queue of one device."""

    def __init__(self, engine: Engine, device: Device, num_threads: int) -> None:
        self.engine = engine
        self.device = device
        self.num_threads = num_threads
        self.queue = ReadyQueue()
        # The queue's heap and ordered deque, for the unlocked peek of evaluate_task (a
        # method call per node of a chain cost more than the peek itself) and run's pop.
        self.heap = self.queue._heap
        self.ordered = self.queue._ordered
        self._entries = self.queue._tasks
        self._threads: list[threading.Thread] = []
        self._start_lock = threading.Lock()
        self._busy_lock = threading.Lock()
        self.busy = 0  # threads running nodes or calls (the watchdog's "every worker held")
        self.closed = False
        self.extra_workers = 0  # started by the watchdog while nodes hold every worker
        self._extra_threads: list[threading.Thread] = []
        self._watched = False
        # The process's CPU budget (one object, updated in place by set_default_engine).
        self._budget = cpu_budget() if device.type == "cpu" else None

    def push(self, task: NodeTask, wake: bool = True) -> None:
        if len(self._threads) < self.num_threads:
            self._start()
        self.queue.push(task, wake)

    def ensure_started(self) -> None:
        if len(self._threads) < self.num_threads:
            self._start()

    def close(self) -> None:
        """Let the worker threads exit once the queue is empty (``Engine.close``)."""
        self.closed = True
        for _ in self._threads:
            self.queue.push_call(_STOP)

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
            if not self._watched and self.device.type == "cpu":
                self._watched = True
                watch(self)

    @property
    def workers(self) -> int:
        """Worker threads, extra ones included."""
        return len(self._threads) + self.extra_workers

    def threads(self) -> list[threading.Thread]:
        """The worker threads, extra ones included."""
        with self._start_lock:
            return [*self._threads, *self._extra_threads]

    def start_extra_worker(self) -> None:
        """Start a worker that serves the queue until it is empty, outside the CPU budget
        (the watchdog's answer to nodes that hold every worker: ``watchdog.py``)."""
        thread = threading.Thread(
            target=self._extra_main, name=f"aioautograd-{self.device}-extra", daemon=True
        )
        with self._start_lock:
            self.extra_workers += 1
            self._extra_threads.append(thread)
        thread.start()

    def _extra_main(self) -> None:
        try:
            self._become_worker()
            worker_state.extra = True
            task = self.queue.pop_nowait()
            while task is not None:
                self.run(task, drain=True)
                task = self.queue.pop_nowait()
        finally:
            forget_engine_thread()
            with self._start_lock:
                self.extra_workers -= 1
                self._extra_threads.remove(threading.current_thread())

    def _become_worker(self) -> None:
        register_engine_thread()
        drop_inherited_slice()
        worker_state.executor = self
        worker_state.depth = 0
        if self.device.type == "cpu":
            lower_priority(self.engine.policy.worker_nice)
        numpy.seterr(all=NUMPY_ERRORS)  # once per thread: see policy.NUMPY_ERRORS

    def _thread_main(self) -> None:
        stopped = False
        try:
            self._become_worker()
            # No local reference survives an iteration: an idle worker must not keep the last
            # graph (and its buffers) alive until its next task.
            while self._serve(self._next_task()):
                pass
            stopped = True
        finally:
            forget_engine_thread()
            if not stopped:  # something escaped (a bug): never leave the pool a thread short
                self._replace(threading.current_thread())

    def _replace(self, dead: threading.Thread) -> None:
        with self._start_lock, contextlib.suppress(ValueError):
            self._threads.remove(dead)
        self._start()

    def _serve(self, item: NodeTask | OffloadedCall | None) -> bool:
        if type(item) is OffloadedCall:
            self._run_call(item)
        elif item is _STOP:
            return False
        else:
            # Hand the task over without keeping a reference here: once run() has marked the
            # thread idle, nothing of the finished pass may stay alive in this frame.
            held: list[NodeTask] = [item]  # type: ignore[list-item]
            del item
            self.run(held.pop(), drain=True)
        return True

    def _next_task(self) -> NodeTask | OffloadedCall | None:
        started = time.perf_counter()
        task: NodeTask | OffloadedCall | None = self.queue.pop()
        now = time.perf_counter()
        hold = self.engine.policy.gil_hold_s
        if now - started > hold * SLEPT_FRACTION_OF_HOLD:  # it slept: a fresh hold starts
            worker_state.pause_at = now + hold
        return task

    def run(self, task: NodeTask | None, drain: bool = False) -> None:
        """Evaluate ``task`` and the chain of same-device successors it makes ready
        (executor thread). While it runs, the thread counts against the CPU budget, and it
        waits between two nodes while the budget is overdrawn. With ``drain``, it goes on
        with the NodeTasks already queued, so that a graph whose nodes go through the queue
        (a fan) pays this set-up once, not once per node."""
        evaluate_task = _evaluate_task or _load_evaluate_task()
        engine = self.engine
        heap = self.heap
        ordered = self.ordered
        lock = self.queue._lock
        entries = self._entries
        heappop = heapq.heappop
        state = worker_state
        budget = self._budget if not state.extra else None
        perf_counter = time.perf_counter
        # A copy of the thread-local ``pause_at`` (a thread-local read per node cost ~570
        # instructions): every write moves it later, so the copy is never later than it, and
        # pause_if_due checks it again.
        pause_at = state.pause_at
        counted = self._begin_work()
        try:
            # ``while True`` and a break, not ``while task is not None``: CPython 3.11 warms a
            # function up (specializes its attribute reads and calls) on its calls and on a
            # plain backward jump, not on a conditional one, so this loop, entered once per
            # backward pass, ran unspecialized for the first eight passes (callgrind: ~1.1k
            # instructions per node of a fan, ~0.65k of a chain).
            while True:
                if task is None:
                    break
                try:
                    task = evaluate_task(engine, task, self, drain)
                except BaseException as exc:  # a bug outside the node's own error handling
                    task.graph_task.abort(exc)  # type: ignore[union-attr]
                    task = None
                if perf_counter() > pause_at:
                    pause_if_due()
                    pause_at = state.pause_at
                if budget is not None and budget.active > budget.cores:  # overdrawn
                    budget.wait_for_core()
                if task is None and drain and ordered:
                    # ReadyQueue.pop_nowait, inlined (once per node of a fan): checked again
                    # under the queue's lock (``ordered`` is empty only while the heap is)
                    lock.acquire()
                    try:
                        if ordered:  # (ReadyQueue._take)
                            if heap and heap[0] < -(ordered[0].key << TIE_BITS):
                                task = entries.pop(heappop(heap))
                            else:
                                task = ordered.popleft()
                    finally:
                        lock.release()
        finally:
            try:
                if drain:
                    # Going idle: the thread's context must not keep the last graph task (its
                    # buffers, captured gradients, error) alive until its next task.
                    forget_graph_task()
            finally:
                self._end_work(counted)

    def _run_call(self, call: OffloadedCall) -> None:
        counted = self._begin_work()
        try:
            call.run()
        finally:
            self._end_work(counted)

    def _begin_work(self) -> bool:
        """Count this thread as busy, and against the CPU budget (waiting for a core); return
        whether the budget counted it (False on a reentrant run, or for a watchdog's extra
        worker)."""
        with self._busy_lock:
            self.busy += 1
        budget = self._budget
        return budget is not None and not worker_state.extra and budget.enter()

    def _end_work(self, counted: bool) -> None:
        with self._busy_lock:
            self.busy -= 1
        if counted:
            self._budget.leave()  # type: ignore[union-attr]

    def drive(self, graph_task: GraphTask) -> None:
        """Serve this executor's queue on the current thread until ``graph_task`` completes
        (executor thread, inside a node or an offloaded call that started a nested graph
        task with ``backward_sync``/``grad_sync``).

        The nodes run in a context of their own, so the caller's grad mode and current
        graph task are as they were when the nested pass returns.
        """
        if worker_state.depth >= MAX_DEPTH:
            self._drive_on_fresh_thread(graph_task)
            return
        worker_state.depth += 1
        graph_task.owner_queue = self.queue
        context = contextvars.Context()
        budget = self._budget
        queue = self.queue

        def completed() -> bool:
            return graph_task.completed

        try:
            while not graph_task.completed:
                if budget is None or len(queue):
                    task = queue.pop(completed)
                else:
                    with budget.lent():  # sleeping for the next task: the core is free
                        task = queue.pop(completed)
                context.run(self.run, task)
        finally:
            worker_state.depth -= 1

    def _drive_on_fresh_thread(self, graph_task: GraphTask) -> None:
        def main() -> None:
            self._become_worker()
            try:
                self.drive(graph_task)
            finally:
                forget_engine_thread()

        thread = threading.Thread(
            target=main, name=f"aioautograd-{self.device}-reentrant", daemon=True
        )
        budget = self._budget
        with budget.lent() if budget is not None else contextlib.nullcontext():
            # This thread only waits: its core goes to the fresh one.
            thread.start()
            graph_task.wait_completed()
            thread.join()


_evaluate_task: Callable[[Engine, NodeTask, Executor, bool], NodeTask | None] | None = None


def _load_evaluate_task() -> Callable[[Engine, NodeTask, Executor, bool], NodeTask | None]:
    # evaluate.py imports this module (through graph_task.py): bound on first use, because an
    # import statement inside ``run`` cost ~8k instructions per call (callgrind).
    global _evaluate_task
    from aioautograd.engine.evaluate import evaluate_task

    _evaluate_task = evaluate_task
    return evaluate_task


def forget_graph_task() -> None:
    """Clear the calling worker's ``current_graph_task`` (bound on first use: import cycle)."""
    global _current_graph_task
    var = _current_graph_task
    if var is None:
        from aioautograd.engine.graph_task import current_graph_task

        var = _current_graph_task = current_graph_task
    if var.get() is not None:
        var.set(None)


_current_graph_task: contextvars.ContextVar[Any] | None = None


class OffloadedCall:
    """A plain function run on an executor thread for a coroutine (``Engine.offload``), in
    a copy of the caller's context; its result or exception resolves ``future`` on the
    caller's loop. A call cancelled before it starts never runs."""

    __slots__ = ("args", "cancelled", "context", "fn", "future", "kwargs", "loop")

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.context = contextvars.copy_context()
        self.loop = loop
        self.future: asyncio.Future[Any] = loop.create_future()
        self.cancelled = False

    def run(self) -> None:
        """Run the call (executor thread)."""
        if self.cancelled:
            return
        try:
            result = self.context.run(self.fn, *self.args, **self.kwargs)
        except BaseException as exc:  # delivered to the awaiting caller, never to the worker
            self._deliver(None, exc)
        else:
            self._deliver(result, None)
        finally:
            self.args = ()
            self.kwargs = {}

    def _deliver(self, result: Any, error: BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits
            self.loop.call_soon_threadsafe(self._resolve, result, error)

    def _resolve(self, result: Any, error: BaseException | None) -> None:
        future = self.future
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


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
    """On a worker that has held the GIL for about the policy's ``gil_hold_s``, sleep its
    ``gil_pause_s`` (executor thread; called after every node, and before every large
    product of an offloaded step through the CPU budget's ``yield_point``).

    Many small nodes in a row (or a long graph walk) hold the GIL between NumPy calls that
    never release it: a thread waiting for it, the event loop's, would get it only after
    CPython's switch interval (5 ms). And while every core computes, the loop's thread
    waits for one until the kernel preempts a worker (3-4 ms measured with two workers
    busy on two cores). A short sleep lets it in now, on both counts. It is skipped when no
    other Python thread can be waiting for either (``devices/gil_waiters.py``; the policy's
    ``gil_pause_always`` takes it anyway).
    """
    state = worker_state
    executor = state.executor
    if executor is None:
        return
    if time.perf_counter() > state.pause_at:
        policy = executor.engine.policy
        if policy.gil_pause_always or others_may_wait():
            time.sleep(policy.gil_pause_s)
        state.pause_at = time.perf_counter() + policy.gil_hold_s


# How often a schedule (``inline._run_schedule`` on an executor) looks at the CPU budget
# between its pauses (every ``gil_hold_s`` / this): the executor's loop looks after every
# node, a schedule's nodes take ~5 µs each and looking costs two calls.
SCHEDULE_LOOKS_PER_HOLD = 5


def schedule_deadline() -> float:
    """(executor) When a schedule running on this thread next calls :func:`schedule_pause`."""
    state = worker_state
    executor = state.executor
    look = executor.engine.policy.gil_hold_s / SCHEDULE_LOOKS_PER_HOLD if executor else 1e-4
    return min(state.pause_at, time.perf_counter() + look)


def schedule_pause() -> float | None:
    """(executor, between two nodes of a schedule) What the executor's loop does between two
    nodes: pause for other threads when due, wait while the CPU budget is overdrawn; return
    the next deadline (:func:`schedule_deadline`), or None when tasks of other passes wait
    in this executor's queue (the schedule then hands its own to the queue, which runs them
    all in its priority order, as it would have without a schedule)."""
    pause_if_due()
    state = worker_state
    executor = state.executor
    if executor is not None:
        if len(executor.queue):
            return None
        budget = executor._budget
        if budget is not None and not state.extra and budget.active > budget.cores:
            budget.wait_for_core()  # (overdrawn)
    return schedule_deadline()


def rested(waited: float) -> None:
    """A worker that has just blocked ``waited`` seconds without the GIL (waiting for the
    helpers of a split product) gave other threads the window a pause gives: when that is
    at least the policy's ``gil_pause_s`` (and ``RESTED_S``), its next pause is due
    ``gil_hold_s`` from now (after a product, the pause would otherwise come at once, with
    every core idle)."""
    state = worker_state
    executor = state.executor
    if executor is None:
        return
    policy = executor.engine.policy
    if waited >= max(policy.gil_pause_s, RESTED_S):
        state.pause_at = max(state.pause_at, time.perf_counter() + policy.gil_hold_s)


CpuBudget.yield_point = staticmethod(pause_if_due)
CpuBudget.rest_point = staticmethod(rested)
