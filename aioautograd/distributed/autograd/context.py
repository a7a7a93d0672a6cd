"""Distributed autograd contexts and their per-worker container (mirrors context.cpp).

A context gathers, on one worker, everything one distributed forward/backward records there:
the ``SendRpcBackward`` nodes of the messages it sent (by autograd message id), the workers
it exchanged tensors with (to release the context on them), and the gradients of its leaves
(accumulated here, never into ``.grad``). Every worker keeps its contexts in a
:class:`DistAutogradContainer`, one per RPC agent (on the ``local`` backend several agents
share a process).
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import threading
import time
from typing import TYPE_CHECKING

from aioautograd.autograd.node import Node

if TYPE_CHECKING:
    from aioautograd.distributed.autograd.send_recv import SendRpcBackward
    from aioautograd.distributed.rpc.agent import RpcAgent
    from aioautograd.tensor import Tensor

# The context of the running task: set by ``context()`` on the caller, and by the receipt of
# a request that carries autograd metadata in the task that runs the remote function.
_current_context: contextvars.ContextVar[DistAutogradContext | None] = contextvars.ContextVar(
    "aioautograd_dist_autograd_context", default=None
)

DEFAULT_CONTEXT_TTL = 1800.0  # seconds an orphaned (never released) context survives
_MAX_SWEEP_S = 10.0  # orphaned contexts are looked for at least this often
_CREATOR_SHIFT = 48  # a context id is (creator's worker id << 48) | counter


class DistAutogradContext:
    """The state of one distributed autograd context on one worker (thread-safe)."""

    def __init__(self, context_id: int, agent: RpcAgent) -> None:
        self.context_id = context_id
        self.agent = agent
        self.known_workers: set[str] = set()
        self.send_functions: dict[int, SendRpcBackward] = {}
        self.roots: list[Node] = []
        self.release_graph = False  # a backward without retain_graph ran in this context
        self.lock = threading.Lock()
        self.last_used = time.monotonic()
        self.active_passes = 0
        self.released = False
        self._grads: dict[int, tuple[Tensor, Tensor]] = {}  # id(leaf) -> (leaf, gradient)

    def __repr__(self) -> str:
        return f"<DistAutogradContext {self.context_id} on {self.agent.info.name}>"

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def add_known_worker(self, name: str) -> None:
        if name != self.agent.info.name:
            with self.lock:
                self.known_workers.add(name)

    def add_send_function(self, node: SendRpcBackward, message_id: int) -> None:
        with self.lock:
            self.send_functions[message_id] = node

    def send_function(self, message_id: int) -> SendRpcBackward:
        with self.lock:
            node = self.send_functions.get(message_id)
        if node is None:
            raise RuntimeError(
                f"no send function for autograd message {message_id} in context "
                f"{self.context_id} on worker {self.agent.info.name!r}"
            )
        return node

    def accumulate(self, leaf: Tensor, grad: Tensor) -> None:
        """The engine's leaf hook: add ``grad`` to the context's gradient of ``leaf``."""
        key = id(leaf)
        with self.lock:
            entry = self._grads.get(key)
            if entry is None:
                self._grads[key] = (leaf, grad.detach().clone())
            else:
                self._grads[key] = (leaf, entry[1] + grad.detach())

    def gradients(self) -> dict[Tensor, Tensor]:
        with self.lock:
            return dict(self._grads.values())

    def release(self) -> None:
        """Drop what the context holds; free the saved tensors of its graph when asked."""
        with self.lock:
            self.released = True
            nodes: list[Node] = [*self.send_functions.values(), *self.roots]
            release = self.release_graph
            self.send_functions.clear()
            self.roots.clear()
            self._grads.clear()
        if release:
            _release_graph(nodes)


def _release_graph(starts: list[Node]) -> None:
    seen: set[Node] = set()
    stack = list(starts)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        with node._lock:
            node.release_variables()
        stack.extend(next_node for next_node, _ in node._next_edges if next_node is not None)


class DistAutogradContainer:
    """One worker's contexts, by id (thread-safe)."""

    def __init__(self, agent: RpcAgent) -> None:
        self.agent = agent
        self._ttl = DEFAULT_CONTEXT_TTL
        self._timer: asyncio.TimerHandle | None = None
        self._dead_creators: set[int] = set()
        self._contexts: dict[int, DistAutogradContext] = {}
        self._owned: set[int] = set()  # contexts created here (released by ``context()``)
        self._lock = threading.Lock()
        self._context_ids = itertools.count(1)
        self._message_ids = itertools.count(1)
        self.num_current_backward_passes = 0

    @property
    def worker_name(self) -> str:
        return self.agent.info.name

    @property
    def ttl(self) -> float:
        """Seconds an idle context created elsewhere survives without being released."""
        return self._ttl

    @ttl.setter
    def ttl(self, seconds: float) -> None:
        self._ttl = seconds
        if self._timer is not None and not self.agent.loop.is_closed():
            self.agent.loop.call_soon_threadsafe(self._schedule)  # the new TTL's pace

    def start_expiry(self) -> None:
        """Look for orphaned contexts on a timer of the agent's loop (call on that loop)."""
        self._schedule()

    def _schedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.agent.is_shut_down:
            self._timer = None
            return
        delay = min(max(self._ttl / 4, 0.01), _MAX_SWEEP_S)
        self._timer = self.agent.loop.call_later(delay, self._sweep)

    def _sweep(self) -> None:
        with self._lock:
            self._expire()
        self._schedule()

    def creator_died(self, worker_id: int) -> None:
        """Drop the contexts that worker ``worker_id`` created (it can never release them);
        one in a backward pass goes once the pass ends."""
        with self._lock:
            self._dead_creators.add(worker_id)
            self._expire()

    def new_context(self) -> DistAutogradContext:
        """A context with an id unique across workers: ``(worker id << 48) | counter``."""
        context_id = (self.agent.info.id << _CREATOR_SHIFT) | next(self._context_ids)
        context = DistAutogradContext(context_id, self.agent)
        with self._lock:
            self._expire()
            self._contexts[context_id] = context
            self._owned.add(context_id)
        return context

    def get_or_create(self, context_id: int) -> DistAutogradContext:
        with self._lock:
            context = self._contexts.get(context_id)
            if context is None:
                self._expire()
                context = self._contexts[context_id] = DistAutogradContext(context_id, self.agent)
        context.touch()
        return context

    def get(self, context_id: int) -> DistAutogradContext:
        with self._lock:
            context = self._contexts.get(context_id)
        if context is None:
            raise RuntimeError(
                f"could not find autograd context with id {context_id} on worker "
                f"{self.worker_name!r}: it was released (or never existed here)"
            )
        context.touch()
        return context

    def pop(self, context_id: int) -> DistAutogradContext | None:
        with self._lock:
            self._owned.discard(context_id)
            return self._contexts.pop(context_id, None)

    def next_message_id(self) -> int:
        return next(self._message_ids)

    def num_contexts(self) -> int:
        with self._lock:
            return len(self._contexts)

    def clear(self) -> None:
        with self._lock:
            contexts = list(self._contexts.values())
            self._contexts.clear()
            self._owned.clear()
        for context in contexts:
            context.release()

    def _expire(self) -> None:
        # Called with the lock held: drop contexts of other workers idle for longer than the
        # TTL (their creator died, or its release never arrived), and at once those of
        # creators known to be dead.
        now = time.monotonic()
        dead = self._dead_creators
        expired = [
            cid
            for cid, ctx in self._contexts.items()
            if cid not in self._owned
            and not ctx.active_passes
            and (now - ctx.last_used > self._ttl or (cid >> _CREATOR_SHIFT) in dead)
        ]
        for cid in expired:
            self._contexts.pop(cid).release()
