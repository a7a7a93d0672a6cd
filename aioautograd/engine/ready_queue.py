"""`ReadyQueue` and `NodeTask` (mirrors engine.h).

Why the priority is ``(reentrant depth, sequence_nr)``, highest first: a reentrant backward
(e.g. a checkpointed segment recomputing inside a node) must finish before its caller can
continue, so its deeper tasks go first; within a graph task, later-created nodes run first,
which follows the reverse of the forward order and lets a node's gradient be complete before
the nodes that feed it run. ``AccumulateGrad`` nodes get the maximum ``sequence_nr`` so
gradients land in ``.grad`` as soon as they are ready.

Both numbers are packed into one integer key (larger = sooner) so the heap compares ints.
Tasks pushed in falling priority (a wide graph walked level by level: every task a fan's
node makes ready ranks below those already queued) skip the heap: they are appended to a
sorted deque, popped from its left in O(1), and the queue pops whichever of the deque's and
the heap's heads ranks higher, so the order is exactly the heap's alone. A task goes to
the heap only while the deque holds one it ranks above (its last), so it pops before that
one: the heap is empty whenever the deque is, and one test of the deque tells whether
anything is queued.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aioautograd.autograd.node import Node
    from aioautograd.engine.graph_task import GraphTask
    from aioautograd.tensor import Tensor

# ``GraphTask.depth_key`` is ``reentrant_depth << DEPTH_SHIFT``; sequence numbers stay below.
DEPTH_SHIFT = 64
# A heap entry is one int, ``tiebreak - (key << TIE_BITS)``: smallest = next to pop, FIFO
# among equal keys. Plain ints compare several times faster than ``(-key, tiebreak, task)``
# tuples, and a fan pops every node through a heap of up to a thousand entries (about 20
# comparisons a pop); the task is found by its entry in a dict. ``entry >> TIE_BITS`` is
# ``-key``, since ``0 <= tiebreak < 2**TIE_BITS``: the tiebreak counts the queue's pushes,
# and 2**64 of them would take centuries, so it is never masked (a mask and the bitwise
# operations on a negative number cost a fan about 1k instructions per node, callgrind).
TIE_BITS = 64
# Bound once: a module attribute lookup per call, for every node a fan queues.
_heappush = heapq.heappush
_heappop = heapq.heappop


class NodeTask:
    """One node of one graph task, with the gradients it received.

    ``outputs`` is set instead when the task continues an ``async`` node that already ran
    on the event loop: only validation and dependency bookkeeping remain.
    """

    # ``tie``: set when the task is queued (its place among equal keys; see ReadyQueue).
    __slots__ = ("graph_task", "inputs", "key", "node", "outputs", "tie")
    tie: int

    def __init__(
        self,
        graph_task: GraphTask,
        node: Node,
        inputs: list[Tensor | None],
        outputs: Sequence[Tensor | None] | None = None,
    ) -> None:
        self.graph_task = graph_task
        self.node = node
        self.inputs = inputs
        self.outputs = outputs
        self.key = graph_task.depth_key | node.sequence_nr


class _Waiter(threading.local):
    """Each thread's private wake-up channel (reused across waits)."""

    def __init__(self) -> None:
        self.channel: queue.SimpleQueue[None] = queue.SimpleQueue()


_waiter = _Waiter()


class ReadyQueue:
    """A thread-safe priority queue of `NodeTask`s for one device.

    Idle threads sleep on a private ``queue.SimpleQueue`` each, registered in ``_waiters``;
    a waker removes a waiter from the list and puts exactly one token in its channel, so no
    wake-up is lost or stolen. A C-level put/get is about half the cost of a
    ``threading.Condition`` round trip, and that hand-off is part of the fixed cost of
    every backward pass.
    """

    def __init__(self) -> None:
        self._heap: list[int] = []
        self._tasks: dict[int, NodeTask] = {}  # heap entry -> its task
        # Tasks whose heap entries would ascend from left to right (falling priority, FIFO
        # among equal keys), each with its tiebreak in ``NodeTask.tie``: a push that ranks
        # at or below the last one goes here, without the heap's sift, the entry's
        # arithmetic or the dict. A fan's nodes all take this path (about 2k instructions a
        # node fewer, callgrind). Empty only while the heap is (see the module's docstring).
        # Between the two heads, equal keys pop the deque's first: a task goes to the heap
        # only above the deque's last key, and that key never rises while the deque holds
        # a task, so a task of the deque whose key equals a heap task's was queued before
        # it. The tiebreak of a task in the deque only names it in ``head_mark``.
        self._ordered: deque[NodeTask] = deque()
        self._calls: deque[Any] = deque()  # offloaded calls, FIFO, after every NodeTask
        self._lock = threading.Lock()
        self._waiters: deque[queue.SimpleQueue[None]] = deque()
        self._tiebreak = itertools.count()

    def push(self, task: NodeTask, wake: bool = True) -> None:
        """Queue ``task``; ``wake=False`` leaves sleeping threads asleep (the pushing thread
        serves this queue and will pop it itself)."""
        lock = self._lock
        lock.acquire()  # (not ``with``: this runs for every node a fan queues)
        try:
            self._put(task, next(self._tiebreak))
            channel = self._waiters.popleft() if wake and self._waiters else None
        finally:
            lock.release()
        if channel is not None:
            channel.put(None)

    def push_local(self, tasks: list[NodeTask], local: NodeTask, pop: bool) -> NodeTask | None:
        """Queue every task of ``tasks`` but ``local`` (the highest-priority one), in their
        order, under one lock and waking no thread (`Engine.dispatch`'s pushes for a thread
        that serves this queue itself), and return the task that thread runs next: ``local``
        unless a queued task ranks higher; else ``local`` is queued too and, with ``pop``,
        the queue's first task is popped and returned in the same lock round trip (a fan's
        node, whose successors rank below the tasks already queued: one lock round trip
        instead of two), without it ``None``."""
        heap = self._heap
        ordered = self._ordered
        tiebreak = self._tiebreak
        key = local.key
        lock = self._lock
        lock.acquire()  # (not ``with``: this runs for every node of a fan)
        try:
            # Whether a queued task ranks above ``local``: a higher key (the successors rank
            # at most as high as ``local``, so this is decided before they are queued).
            if not ordered or not (ordered[0].key > key or (heap and heap[0] < -(key << TIE_BITS))):
                for task in tasks:
                    if task is not local:
                        self._put(task, next(tiebreak))
                return local
            # ``local`` is queued as well (its tiebreak after the others'), and with ``pop``
            # the queue's first task comes back: it ranks above every task queued here, so
            # taking it first pops what a push then a pop would.
            if not pop:
                first = None
            elif not heap:  # _take, written out for a fan's node (``ordered`` holds one)
                first = ordered.popleft()
            else:
                first = self._take()
            if len(tasks) == 2:
                other = tasks[1] if tasks[0] is local else tasks[0]
                if ordered and other.key < key < ordered[-1].key:
                    # A fan's add, written out: both rank below the deque's last task, the
                    # higher one first (``local``, whose tiebreak comes after the other's).
                    other.tie = next(tiebreak)
                    local.tie = next(tiebreak)
                    ordered.append(local)
                    ordered.append(other)
                    return first
            for task in tasks:
                if task is not local:
                    self._put(task, next(tiebreak))
            self._put(local, next(tiebreak))
            return first
        finally:
            lock.release()

    def push_pair(self, first: NodeTask, second: NodeTask, pop: bool) -> NodeTask | None:
        """``push_local([first, second], local, pop)``, ``local`` the first of the two with
        the higher key: a node's two successors (a fan's add), with the fan's case written
        out: both rank below every queued task (none on the heap), so both are appended to
        the deque and, with ``pop``, its first task comes back, in one lock round trip and
        without the list and the general case's tests (~20 bytecodes per add fewer)."""
        if second.key > first.key:
            local, other = second, first
        else:
            local, other = first, second
        key = local.key
        ordered = self._ordered
        lock = self._lock
        lock.acquire()  # (not ``with``: this runs for every add of a fan)
        try:
            if not self._heap and ordered and other.key < key < ordered[-1].key:
                tiebreak = self._tiebreak
                other.tie = next(tiebreak)  # push_local's order: the other one, then local
                local.tie = next(tiebreak)
                ordered.append(local)
                ordered.append(other)
                return ordered.popleft() if pop else None
        finally:
            lock.release()
        # Anything else, decided afresh under the lock (nothing was changed above).
        return self.push_local([first, second], local, pop)

    def _put(self, task: NodeTask, tie: int) -> None:
        """(under the lock) Queue ``task`` with its tiebreak, which must be above every one
        queued: appended to the ordered deque when it ranks at or below its last task
        (FIFO among equal keys), else on the heap."""
        ordered = self._ordered
        key = task.key
        if not ordered or key <= ordered[-1].key:
            task.tie = tie
            ordered.append(task)
            return
        item = tie - (key << TIE_BITS)
        self._tasks[item] = task
        _heappush(self._heap, item)

    def _take(self) -> NodeTask | None:
        """(under the lock) Pop the first NodeTask: the higher of the two heads."""
        ordered = self._ordered
        if not ordered:
            return None
        heap = self._heap
        if heap and heap[0] < -(ordered[0].key << TIE_BITS):  # a higher key (equal: the deque)
            return self._tasks.pop(_heappop(heap))
        return ordered.popleft()

    def push_call(self, call: Any) -> None:
        """Queue an offloaded call (``Engine.offload``): it runs when no NodeTask waits.

        Every sleeping thread is woken: those driving a nested graph task do not take calls
        and go back to sleep (calls are whole training steps: rare next to NodeTasks).
        """
        with self._lock:
            self._calls.append(call)
            channels = list(self._waiters)
            self._waiters.clear()
        for channel in channels:
            channel.put(None)

    def pop(self, stop: Callable[[], bool] | None = None) -> Any:
        """Block until a task is available; return ``None`` early once ``stop()`` is true.

        With ``stop`` (a thread driving a nested graph task), only NodeTasks are returned:
        a thread waiting for its own backward pass must not start an offloaded call.
        """
        ordered = self._ordered
        calls = self._calls
        lock = self._lock
        channel = _waiter.channel
        while True:
            with lock:
                if ordered:
                    return self._take()
                if stop is None:
                    if calls:
                        return calls.popleft()
                elif stop():
                    return None
                self._waiters.append(channel)
            channel.get()  # removed from _waiters by whoever put the token

    def pop_nowait(self) -> NodeTask | None:
        """The next NodeTask if one is queued, else ``None`` (never an offloaded call)."""
        if not self._ordered:  # an unlocked peek: a hint, checked again under the lock
            return None
        lock = self._lock
        lock.acquire()
        try:
            return self._take()
        finally:
            lock.release()

    def top_key(self) -> int | None:
        """The key of the next task to pop, or ``None`` (an unlocked peek: a hint only)."""
        ordered = self._ordered
        if not ordered:  # the common case, without raising
            return None
        heap = self._heap
        try:
            top: int = ordered[0].key
            if heap:
                top = max(top, -(heap[0] >> TIE_BITS))
        except IndexError:  # emptied by another thread since the test
            return None
        return top

    def head_mark(self) -> int | None:
        """An identity of the item to pop next (``None`` if empty): unchanged over time
        while nothing is popped (an unlocked peek, for the watchdog)."""
        heap = self._heap
        ordered = self._ordered
        try:
            if ordered:  # the first task's entry (unique while queued: its tiebreak)
                first = ordered[0]
                entry = first.tie - (first.key << TIE_BITS)
                return min(entry, heap[0]) if heap else entry
        except IndexError:  # changed by another thread since the test
            return None
        calls = self._calls
        try:
            return id(calls[0])
        except IndexError:
            return None

    def wake_all(self) -> None:
        """Wake every sleeping thread (so that one driving a finished graph task returns)."""
        with self._lock:
            channels = list(self._waiters)
            self._waiters.clear()
        for channel in channels:
            channel.put(None)

    def __len__(self) -> int:
        return len(self._heap) + len(self._ordered) + len(self._calls)
