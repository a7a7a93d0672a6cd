"""`DistributedOptimizer`: steps parameters that live on several workers with the gradients
of a distributed autograd context (``torch.distributed.optim.DistributedOptimizer``).

One local optimizer is created on each owner of parameters (over RPC, kept there behind an
RRef); ``await step(context_id)`` steps them all concurrently, each with the gradients the
context accumulated on its worker. ``.grad`` is left as it was.

The optimizer class travels by name, never as code: it must be one of ``aioautograd.optim``'s
optimizers or a class registered with :func:`register_optimizer` on every worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator, Sequence
from typing import Any

from aioautograd import optim as local_optim
from aioautograd.autograd.unawaited import _pending, check_awaited
from aioautograd.distributed.autograd.dist_engine import INTERNAL_FUNCTIONS, container_of
from aioautograd.distributed.rpc.futures import settle
from aioautograd.distributed.rpc.registry import INTERNAL_PREFIX, default_name
from aioautograd.distributed.rpc.rref import RRef
from aioautograd.distributed.rpc.worker import WorkerInfo, current_agent
from aioautograd.grad_mode import no_grad

CREATE = f"{INTERNAL_PREFIX}dist_optim_create"
STEP = f"{INTERNAL_PREFIX}dist_optim_step"

_optimizers: dict[str, type[local_optim.Optimizer]] = {
    default_name(cls): cls for cls in (local_optim.SGD, local_optim.Adam, local_optim.AdamW)
}


def register_optimizer(cls: type[local_optim.Optimizer]) -> type[local_optim.Optimizer]:
    """Allow ``cls`` in :class:`DistributedOptimizer` (a decorator; do it on every worker)."""
    if not (isinstance(cls, type) and issubclass(cls, local_optim.Optimizer)):
        raise TypeError(f"{cls!r} is not an aioautograd Optimizer subclass")
    _optimizers[default_name(cls)] = cls
    return cls


class _LocalOptimizer:
    """The optimizer of one owner, kept in its owner table."""

    def __init__(
        self, cls: type[local_optim.Optimizer], params: list[Any], kwargs: dict[str, Any]
    ) -> None:
        self.params = params
        self.optimizer = cls(params, **kwargs)

    def step(self, context_id: int) -> None:
        grads = container_of().get(context_id).gradients()
        saved = [param.grad for param in self.params]
        try:
            with no_grad():
                for param in self.params:
                    grad = grads.get(param)
                    param.grad = None if grad is None else grad.clone()
            self.optimizer.step()
        finally:
            for param, grad in zip(self.params, saved, strict=True):
                param.grad = grad


async def _create(
    src: WorkerInfo, name: str, param_rrefs: list[RRef[Any]], kwargs: dict[str, Any]
) -> Any:
    cls = _optimizers.get(name)
    if cls is None:
        raise ValueError(
            f"optimizer class {name!r} is not allowed on worker "
            f"{current_agent().info.name!r}: register it with register_optimizer"
        )
    return _LocalOptimizer(cls, [rref.local_value() for rref in param_rrefs], kwargs)


async def _step(src: WorkerInfo, optimizer_rref: RRef[_LocalOptimizer], context_id: int) -> None:
    # The optimizer's own ``remote()`` creation may still be running on this owner.
    optimizer = await optimizer_rref.to_here()
    optimizer.step(context_id)


INTERNAL_FUNCTIONS[CREATE] = _create
INTERNAL_FUNCTIONS[STEP] = _step


class DistributedOptimizer:
    """Optimise parameters spread over workers (given as RRefs) with context gradients.

    Args:
        optimizer_class: An ``aioautograd.optim`` optimizer (or a registered one).
        params_rref: RRefs to the parameters (leaf tensors); each owner gets one local
            optimizer over its parameters.
        **kwargs: The optimizer's hyperparameters (numbers, strings, lists).

    Must be created on the RPC agent's event loop. Creation starts the owners' optimizers;
    ``await`` the object to wait for them (PyTorch's constructor does): a creation error
    (an unknown optimizer class, bad hyperparameters, a parameter that is not a leaf)
    is raised there, or else by the first :meth:`step`.

    Example::

        opt = await DistributedOptimizer(optim.SGD, param_rrefs, lr=0.05)
        async with dist_autograd.context() as context_id:
            ...
            await opt.step(context_id)
    """

    def __init__(
        self,
        optimizer_class: type[local_optim.Optimizer],
        params_rref: Sequence[RRef[Any]],
        **kwargs: Any,
    ) -> None:
        name = default_name(optimizer_class)
        if _optimizers.get(name) is not optimizer_class:
            raise ValueError(
                f"{name} is not an allowed optimizer class: use an aioautograd.optim optimizer "
                "or register it with register_optimizer on every worker"
            )
        by_owner: dict[str, list[RRef[Any]]] = {}
        for rref in params_rref:
            by_owner.setdefault(rref.owner_name(), []).append(rref)
        agent = current_agent()
        self.remote_optimizers: list[RRef[_LocalOptimizer]] = [
            agent.remote(owner, CREATE, (name, rrefs, kwargs)) for owner, rrefs in by_owner.items()
        ]

    def __await__(self) -> Generator[Any, None, DistributedOptimizer]:
        return self.wait().__await__()

    async def wait(self) -> DistributedOptimizer:
        """Wait until every owner has created its optimizer; returns ``self``.

        Raises:
            RemoteError: an owner failed to create its optimizer (its name and message).
        """
        creations = [rref._creation for rref in self.remote_optimizers]
        pending = [task for task in creations if task is not None]
        if all(task.done() for task in pending):
            # Every step after the first: no gather (its callbacks cost loop iterations).
            for task in pending:
                task.result()  # the first creation error, as gather raises it
            return self
        await asyncio.gather(*pending)
        return self

    async def step(self, context_id: int) -> None:
        """Step every owner's optimizer concurrently with context ``context_id``'s gradients.

        Raises:
            RemoteError: an owner failed to create its optimizer, or to step (e.g. it does
                not know the context).
            RuntimeError: when this task called ``dist_autograd.backward()`` without
                ``await``.
        """
        if _pending.items:
            check_awaited()
        await self.wait()
        agent = current_agent()
        # The other owners' steps are sent first; this worker's own optimizer then steps
        # here, in this task (PyTorch sends an RPC to itself: the same work, plus a copy of
        # the message and a task), while their requests travel.
        remote = [
            agent.call_soon(rref.owner(), STEP, (rref, context_id))
            for rref in self.remote_optimizers
            if not rref.is_owner()
        ]
        try:
            for rref in self.remote_optimizers:
                if rref.is_owner():
                    rref.local_value().step(context_id)
        finally:
            # Every step finishes (or fails) before this returns, as PyTorch waits for all.
            results = await settle(remote)
        for result in results:
            if isinstance(result, BaseException):
                raise result
