"""The distributed engine: the RPC interceptor, the internal RPC handlers and ``backward``
(FAST mode of dist_engine.cpp, one local graph task per incoming gradient).

Backpropagation is linear in the incoming gradient, so a distributed backward pass is a set
of local passes: one on the caller from the roots, and one on a worker each time a
``RecvRpcBackward`` sends it the gradients of one message, rooted at that message's
``SendRpcBackward``. Each ``RecvRpcBackward`` awaits the pass it starts, so the caller's
``backward`` returns only when every pass on every worker has finished; a send that never
receives a gradient starts no pass and blocks nothing. Leaves accumulate into the context
through the engine's leaf hook. Passes keep the graph (a subgraph may be reached by several
passes); it is released with the context.

Gradients for a worker that awaits the running pass travel in its answer. A ``BACKWARD``
request names the chain of workers whose ``RecvRpcBackward`` waits for it (the root first).
When a pass served here reaches a ``RecvRpcBackward`` of the pass's context whose sender is
on that chain, it does not call the sender (who would answer only after its own pass: one
more round trip on the critical path) but puts the gradients in this pass's answer; the
``RecvRpcBackward`` on the chain that receives them runs their pass before it returns (or
hands them on up the chain), so it still ends only when every pass it caused has ended, and
an error in one still fails it. In a two-worker step (the root sends its gradient to worker
1, whose pass sends one back) the backward is one round trip instead of two.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from aioautograd.autograd.node import Edge
from aioautograd.autograd.unawaited import track
from aioautograd.distributed.autograd.context import (
    DistAutogradContainer,
    DistAutogradContext,
    _context_task,
    _current_context,
)
from aioautograd.distributed.autograd.send_recv import RecvRpcBackward, SendRpcBackward
from aioautograd.distributed.rpc.agent import RpcAgent
from aioautograd.distributed.rpc.errors import MalformedMessageError
from aioautograd.distributed.rpc.futures import settle
from aioautograd.distributed.rpc.interceptors import (
    MessageInfo,
    RpcInterceptor,
    register_interceptor_factory,
)
from aioautograd.distributed.rpc.registry import INTERNAL_PREFIX
from aioautograd.distributed.rpc.rref import FETCH, METHOD, RREF_BACKWARD, RRef, _checked_root
from aioautograd.distributed.rpc.worker import WorkerInfo, current_agent, from_backward
from aioautograd.engine.api import _make_grads, _root_edges
from aioautograd.engine.engine import Engine
from aioautograd.engine.graph_task import current_graph_task
from aioautograd.tensor import Tensor

logger = logging.getLogger("aioautograd.distributed.autograd")

INTERCEPTOR = "dist_autograd"
BACKWARD = f"{INTERNAL_PREFIX}dist_autograd_backward"
RELEASE = f"{INTERNAL_PREFIX}dist_autograd_release"

# Internal RPC functions installed on every agent (``module`` adds its own, e.g. the
# distributed optimizer); each receives the calling worker's WorkerInfo first.
INTERNAL_FUNCTIONS: dict[str, Any] = {}

# Internal functions whose requests carry the caller's context like user calls: the callee
# runs in it, so an RRef's value fetched (``to_here``) or a method run through an RRef proxy
# inside a context is recorded for backward.
CONTEXT_FUNCTIONS = frozenset({FETCH, METHOD})


@dataclass(slots=True)
class ServedPass:
    """A pass this worker runs for a ``BACKWARD`` request of context ``context_id``: the
    workers awaiting its answer (the root first) and the gradients for them its
    ``RecvRpcBackward`` nodes of that context left in it, ``[worker, message_id, grads]``
    each."""

    context_id: int
    chain: tuple[str, ...]
    deferred: list[list[Any]]


# The served pass of the running backward (None on the root: nobody awaits its answer).
_served_pass: ContextVar[ServedPass | None] = ContextVar(
    "aioautograd_dist_autograd_served_pass", default=None
)


def task_context() -> DistAutogradContext | None:
    """The context of the running task, or of the task whose backward pass runs here (a
    node on an executor thread)."""
    context = _current_context.get()
    return context if context is not None else from_backward(_current_context)


class DistAutogradInterceptor(RpcInterceptor):
    """Records send/recv functions for the messages of one worker (see the module doc)."""

    def __init__(self, agent: RpcAgent) -> None:
        self.agent = agent
        self.container = DistAutogradContainer(agent)
        self.container.start_expiry()

    def _context(self) -> DistAutogradContext | None:
        context = task_context()
        if context is None or context.agent is not self.agent or context.released:
            return None
        return context

    def on_send(self, info: MessageInfo, tensors: Sequence[Tensor]) -> Any:
        context = self._context()
        if context is None:
            return None
        context.add_known_worker(info.dst.name)
        needing = [tensor for tensor in tensors if tensor.requires_grad]
        if not needing:
            # A user request still carries the context, so that the callee records its
            # response (parameters on the callee make it require grad).
            user_request = info.kind == "request" and (
                not info.function.startswith(INTERNAL_PREFIX) or info.function in CONTEXT_FUNCTIONS
            )
            return [context.context_id, None] if user_request else None
        message_id = self.container.next_message_id()
        context.add_send_function(SendRpcBackward(needing), message_id)
        return [context.context_id, message_id]

    def on_receive(self, info: MessageInfo, tensors: list[Tensor], metadata: Any) -> list[Tensor]:
        if metadata is None:
            return tensors
        context_id, message_id = metadata
        context = self.container.get_or_create(context_id)
        context.add_known_worker(info.src.name)
        if info.kind == "request":  # the remote function runs in this context
            _current_context.set(context)
            _context_task.set(asyncio.current_task())
        if message_id is None:
            return tensors
        recv = RecvRpcBackward(self.agent, context_id, message_id, info.src)
        context.add_recv_function(recv, message_id)
        return recv.wrap(tensors)

    def on_stop(self) -> None:
        # After the shutdown barrier: peers may run backward passes through this worker's
        # contexts until every worker has reached shutdown.
        self.container.clear()

    def on_worker_dead(self, worker: WorkerInfo) -> None:
        self.container.creator_died(worker.id)


def _install(agent: RpcAgent) -> DistAutogradInterceptor:
    # Internal functions: refused by no allow-list, called with the caller's WorkerInfo.
    agent._internal.update(INTERNAL_FUNCTIONS)
    return DistAutogradInterceptor(agent)


register_interceptor_factory(INTERCEPTOR, _install)


def container_of(agent: RpcAgent | None = None) -> DistAutogradContainer:
    """The context container of ``agent`` (default: the current worker's)."""
    agent = agent if agent is not None else current_agent()
    interceptor = agent.get_interceptor(INTERCEPTOR)
    if not isinstance(interceptor, DistAutogradInterceptor):
        raise RuntimeError(
            f"distributed autograd is not installed on worker {agent.info.name!r}: import "
            "aioautograd.distributed before calling init_rpc"
        )
    return interceptor.container


# ------------------------------------------------------------------------------ passes
async def run_pass(
    container: DistAutogradContainer,
    context: DistAutogradContext,
    roots: Sequence[Edge],
    grads: Sequence[Tensor | None],
    served: ServedPass | None = None,
) -> None:
    """One local pass of a distributed backward: leaves accumulate into ``context``;
    ``served``: the request it answers (None on the root)."""
    with context.lock:
        context.active_passes += 1
    # Nodes (a Function.backward on an executor thread) see the context and the worker;
    # RecvRpcBackward nodes see who awaits the pass.
    token = _current_context.set(context)
    served_token = _served_pass.set(served)
    try:
        await Engine.get_default_engine().execute(
            roots, grads, True, False, True, leaf_hook=context.accumulate
        )
    finally:
        _served_pass.reset(served_token)
        _current_context.reset(token)
        with context.lock:
            context.active_passes -= 1
        context.touch()


def backward(
    context_id: int, roots: Sequence[Tensor], retain_graph: bool = False
) -> Coroutine[Any, Any, None]:
    """Run the distributed backward pass of context ``context_id`` from scalar ``roots``.

    Returns a coroutine to ``await``; :func:`get_gradients` after calling it without
    ``await`` raises an error that says so.

    Gradients accumulate into the context on every worker that holds leaves
    (:func:`get_gradients`), never into ``.grad``. Returns when the passes on every worker
    involved have finished. Several backward passes in one context accumulate.
    ``retain_graph=False`` frees the saved tensors of the context's graph, on every worker
    it spans, when the context is released (at the end of ``async with context()``), not at
    once: until then the graph may still be traversed.

    Raises:
        RuntimeError: unknown context; no roots; a root that does not require grad, is not
            a scalar, or has no gradient function (a leaf), as in PyTorch.
        RemoteError: a pass failed on another worker (its name and message included).
        RpcTimeoutError, WorkerUnavailableError: a worker did not answer in time or died.
    """
    return track(
        _backward(context_id, roots, retain_graph),
        "dist_autograd.backward(context_id, roots)",
    )


async def _backward(context_id: int, roots: Sequence[Tensor], retain_graph: bool) -> None:
    container = container_of()
    context = container.get(context_id)
    outputs = tuple(roots) if isinstance(roots, (list, tuple)) else (roots,)
    if not outputs:
        raise RuntimeError("No tensors provided for gradient computation: pass the loss(es)")
    for i, root in enumerate(outputs):
        if not isinstance(root, Tensor):
            raise TypeError(f"backward roots are tensors, root {i} is {type(root).__name__}")
        if not root.requires_grad:
            raise RuntimeError(f"requires_grad not set on root {i}: it has no graph to go through")
        if root.numel() != 1:
            raise RuntimeError(
                f"root {i} of shape {tuple(root.shape)} is not a scalar, all roots need to be "
                "scalar (reduce it, e.g. `.sum()`)"
            )
        if root.grad_fn is None:
            raise RuntimeError(
                f"root {i} does not have a valid gradient function: it is a leaf (backward "
                "starts from a tensor computed from the leaves)"
            )
    edges = _root_edges(outputs)
    grads = _make_grads(outputs, (None,) * len(outputs))
    with context.lock:
        context.roots.extend(node for node, _ in edges if node is not None)
        if not retain_graph:
            context.release_graph = True
    await run_pass(container, context, edges, grads)


async def send_gradients(node: RecvRpcBackward, grads: list[Tensor | None]) -> None:
    """``RecvRpcBackward.apply``: start the pass of ``grads`` on the worker that sent the
    node's tensors and wait for it, or leave them in the answer of the served pass when that
    worker awaits it (see the module doc)."""
    served = _served_pass.get()
    if served is not None and served.context_id != node.context_id:
        # A tensor of another context, used in this one: the answer's gradients are run in
        # the answer's context, so these take a request of their own, awaited here.
        served = None
    sender = node.sender.name
    if served is not None and sender in served.chain:
        served.deferred.append([sender, node.message_id, grads])
        return
    agent = node.agent
    me = agent.info.name
    chain = [me] if served is None else [*served.chain, me]
    deferred = await agent.call(
        node.sender, BACKWARD, (node.context_id, node.message_id, grads, chain)
    )
    if deferred:
        await _run_deferred(agent, node.context_id, deferred, served)


async def _run_deferred(
    agent: RpcAgent, context_id: int, deferred: Any, served: ServedPass | None
) -> None:
    # The gradients a BACKWARD answer brought back: this worker's run in one pass (by
    # message id: the same order whatever the scheduling was), the rest go on up the chain.
    me = agent.info.name
    mine: list[tuple[int, list[Tensor | None]]] = []
    if not isinstance(deferred, list):
        raise MalformedMessageError("malformed backward answer: expected a list of gradients")
    for entry in deferred:
        if not (
            isinstance(entry, list)
            and len(entry) == 3
            and isinstance(entry[0], str)
            and isinstance(entry[1], int)
            and isinstance(entry[2], list)
        ):
            raise MalformedMessageError(
                "malformed backward answer: expected [worker, message_id, gradients] entries"
            )
        worker, message_id, grads = entry
        if worker == me:
            mine.append((message_id, grads))
        elif served is not None and worker in served.chain:
            served.deferred.append(entry)
        else:
            raise MalformedMessageError(
                f"malformed backward answer: gradients for worker {worker!r}, which does not "
                f"await this pass on worker {me!r}"
            )
    if not mine:
        return
    container = container_of(agent)
    context = container.get(context_id)
    roots: list[Edge] = []
    inputs: list[Tensor | None] = []
    for message_id, grads in sorted(mine, key=itemgetter(0)):
        _add_roots(context.send_function(message_id), grads, roots, inputs)
    if not roots:
        return
    # A pass of its own, as a request's would be (not a reentrant child of the pass that
    # awaits this node: that one would never run inline).
    token = current_graph_task.set(None)
    try:
        await run_pass(container, context, roots, inputs, served)
    finally:
        current_graph_task.reset(token)


def _add_roots(
    send: SendRpcBackward,
    grads: list[Tensor | None],
    roots: list[Edge],
    inputs: list[Tensor | None],
) -> None:
    for i, grad in enumerate(grads):
        if grad is not None:
            roots.append((send, i))
            inputs.append(grad)


# ---------------------------------------------------------------------- internal handlers
async def _backward_handler(
    src: WorkerInfo,
    context_id: int,
    message_id: int,
    grads: list[Tensor | None],
    chain: list[str],
) -> list[list[Any]] | None:
    # Answers the gradients its pass left for the workers of ``chain`` (None: none).
    if not (isinstance(chain, list) and all(isinstance(name, str) for name in chain)):
        raise MalformedMessageError("malformed backward request: expected a list of workers")
    container = container_of()
    context = container.get(context_id)
    roots: list[Edge] = []
    inputs: list[Tensor | None] = []
    _add_roots(context.send_function(message_id), grads, roots, inputs)
    if not roots:
        return None
    served = ServedPass(context_id, tuple(chain), [])
    await run_pass(container, context, roots, inputs, served)
    return served.deferred or None


async def release_on(agent: RpcAgent, context: DistAutogradContext, skip: str | None) -> None:
    """Release ``context`` on the workers it knows (but ``skip``), awaiting their acks."""
    with context.lock:
        workers = sorted(context.known_workers - {skip, agent.info.name})
        release_graph = context.release_graph
    if not workers:
        return
    message = (context.context_id, release_graph)
    results = await settle([agent.call(worker, RELEASE, message) for worker in workers])
    for worker, result in zip(workers, results, strict=True):
        if isinstance(result, BaseException):
            logger.warning(
                "worker %r could not release autograd context %d on worker %r: %s",
                agent.info.name,
                context.context_id,
                worker,
                result,
            )


async def _release_handler(src: WorkerInfo, context_id: int, release_graph: bool = False) -> None:
    # ``release_graph``: a backward without retain_graph ran in the context (on its root):
    # this worker's part of the graph frees its saved tensors too, as the root's does.
    if not isinstance(release_graph, bool):
        raise MalformedMessageError("malformed release request: release_graph is not a bool")
    agent = current_agent()
    context = container_of(agent).pop(context_id)
    if context is None:  # released already (reached through another worker)
        return
    if release_graph:
        with context.lock:
            context.release_graph = True
    context.release()
    await release_on(agent, context, src.name)


async def _rref_backward_handler(
    src: WorkerInfo, rref: RRef[Any], context_id: int, retain_graph: bool
) -> None:
    # RRef.backward(context_id) from any worker: a distributed backward from the value.
    if not isinstance(rref, RRef) or not rref.is_owner():
        raise RuntimeError("RRef.backward reached a worker that does not own the RRef")
    await backward(context_id, [_checked_root(rref.local_value())], retain_graph)


INTERNAL_FUNCTIONS[BACKWARD] = _backward_handler
INTERNAL_FUNCTIONS[RREF_BACKWARD] = _rref_backward_handler
INTERNAL_FUNCTIONS[RELEASE] = _release_handler
