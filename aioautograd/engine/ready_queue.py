"""`ReadyQueue` and `NodeTask` (mirrors engine.h).

Why the priority is ``(reentrant depth, sequence_nr)``, highest first: a reentrant backward
(e.g. a checkpointed segment recomputing inside a node) must finish before its caller can
continue, so its deeper tasks go first; within a graph task, later-created nodes run first,
which follows the reverse of the forward order and lets a node's gradient be complete before
the nodes that feed it run. ``AccumulateGrad`` nodes get the maximum ``sequence_nr`` so
gradients land in ``.grad`` as soon as they are ready.

Both numbers are packed into one integer key (larger = sooner) so the heap compares ints.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aioautograd.autograd.node import Node
    from aioautograd.engine.graph_task import GraphTask
    from aioautograd.tensor import Tensor

# ``GraphTask.depth_key`` is ``reentrant_depth << DEPTH_SHIFT``; sequence numbers stay below.
DEPTH_SHIFT = 64


class NodeTask:
    """One node of one graph task, with the gradients it received.

    ``outputs`` is set instead when the task continues an ``async`` node that already ran
    on the event loop: only validation and dependency bookkeeping remain.
    """

    __slots__ = ("graph_task", "inputs", "key", "node", "outputs")

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


class ReadyQueue:
    """A thread-safe priority queue of `NodeTask`s for one device.

    Idle workers sleep on a ``queue.SimpleQueue`` of wake-up tokens rather than a
    ``threading.Condition``: a C-level put/get is about half the cost of a Python condition
    round trip, and that hand-off is part of the fixed cost of every backward pass.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Any]] = []
        self._lock = threading.Lock()
        self._wakeups: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._waiting = 0
        self._tiebreak = itertools.count()

    def push(self, task: NodeTask) -> None:
        item = (-task.key, next(self._tiebreak), task)
        with self._lock:
            heapq.heappush(self._heap, item)
            wake = self._waiting > 0
        if wake:
            self._wakeups.put(None)

    def pop(self, stop: Callable[[], bool] | None = None) -> NodeTask | None:
        """Block until a task is available; return ``None`` early once ``stop()`` is true."""
        heap = self._heap
        lock = self._lock
        while True:
            with lock:
                if heap:
                    task: NodeTask = heapq.heappop(heap)[2]
                    return task
                if stop is not None and stop():
                    return None
                self._waiting += 1
            # A token put after our registration wakes us; a stale one only costs a loop.
            self._wakeups.get()
            with lock:
                self._waiting -= 1

    def top_key(self) -> int | None:
        """The key of the next task to pop, or ``None`` (an unlocked peek: a hint only)."""
        heap = self._heap
        try:
            return -heap[0][0]
        except IndexError:
            return None

    def wake_all(self) -> None:
        """Wake every sleeping worker (so that one driving a finished graph task returns)."""
        with self._lock:
            waiting = self._waiting
        for _ in range(waiting):
            self._wakeups.put(None)

    def __len__(self) -> int:
        return len(self._heap)
