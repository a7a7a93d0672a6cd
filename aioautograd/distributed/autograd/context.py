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
    from aioautograd.distributed.autograd.send_recv import RecvRpcBackward, SendRpcBackward
    from aioautograd.distributed.rpc.agent import RpcAgent
    from aioautograd.tensor import Tensor

# The context of the running task: set by ``context()`` on the caller, and by the receipt of
# a request that carries autograd metadata in the task that runs the remote function.
_current_context: contextvars.ContextVar[DistAutogradContext | None] = contextvars.ContextVar(
    "aioautograd_dist_autograd_context", default=None
)

# The task that entered that context (``context()``, or the task that serves a request in it):
# a second ``context()`` in that same task is a nested context, which PyTorch refuses.
_context_task: contextvars.ContextVar[object | None] = contextvars.ContextVar(
    "aioautograd_dist_autograd_context_task", default=None
)

_ID_BITS = 48  # context and message ids: (worker id << 48) | a per-worker counter
MAX_COUNTER = (1 << _ID_BITS) - 1

DEFAULT_CONTEXT_TTL = 1800.0  # seconds an orphaned (never released) context survives
_MAX_SWEEP_S = 10.0  # orphaned contexts are looked for at least this often
_CREATOR_SHIFT = _ID_BITS  # a context id is (creator's worker id << 48) | counter


class DistAutogradContext:
    """The state of one distributed autograd context on one worker (thread-safe).

    For debugging (PyTorch's ``_send_functions()``, ``_recv_functions()`` and
    ``_known_worker_ids()``): ``send_functions`` and ``recv_functions`` map autograd message
    ids (unique across workers) to the ``SendRpcBackward`` / ``RecvRpcBackward`` nodes this
    worker recorded in the context, ``known_workers`` names the workers it exchanged
    tensors with. Read them with ``lock`` held, or through :meth:`snapshot`.
    """

    def __init__(self, context_id: int, agent: RpcAgent) -> None:
        self.context_id = context_id
        self.agent = agent
        self.known_workers: set[str] = set()
        self.send_functions: dict[int, SendRpcBackward] = {}
        self.recv_functions: dict[int, RecvRpcBackward] = {}
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

    def add_recv_function(self, node: RecvRpcBackward, message_id: int) -> None:
        with self.lock:
            self.recv_functions[message_id] = node

    def snapshot(self) -> dict[str, object]:
        """A copy of the introspection fields: ``context_id``, ``worker``,
        ``send_functions``, ``recv_functions``, ``known_workers`` and ``active_passes``."""
        with self.lock:
            return {
                "context_id": self.context_id,
                "worker": self.agent.info.name,
                "send_functions": dict(self.send_functions),
                "recv_functions": dict(self.recv_functions),
                "known_workers": sorted(self.known_workers),
                "active_passes": self.active_passes,
            }

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
            self.recv_functions.clear()
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
        self._id_base = agent.info.id << _ID_BITS

    @property
    def num_current_backward_passes(self) -> int:
        """Contexts with a backward pass running on this worker (PyTorch counts contexts:
        the nested local passes of one distributed backward count once)."""
        with self._lock:
            return sum(1 for context in self._contexts.values() if context.active_passes)

    @property
    def max_id(self) -> int:
        """The largest context (and message) id this worker can issue (PyTorch's
        ``_get_max_id()``)."""
        return self._id_base + MAX_COUNTER

    def _next_id(self, counter: itertools.count[int], what: str) -> int:
        value = next(counter)
        if value > MAX_COUNTER:
            raise RuntimeError(
                f"worker {self.worker_name!r} ran out of distributed autograd {what} ids "
                f"(2**{_ID_BITS} per worker): restart the worker"
            )
        return self._id_base | value

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
        context_id = self._next_id(self._context_ids, "context")
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
        """An autograd message id unique across workers (recv functions are keyed by it)."""
        return self._next_id(self._message_ids, "message")

    def contexts(self) -> list[DistAutogradContext]:
        with self._lock:
            return list(self._contexts.values())

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
