"""The public functions of ``aioautograd.distributed.rpc`` (PyTorch's names and semantics)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from aioautograd.distributed.rpc.agent import RpcAgent
from aioautograd.distributed.rpc.backends import create_agent
from aioautograd.distributed.rpc.futures import RpcFuture
from aioautograd.distributed.rpc.options import RpcBackendOptions
from aioautograd.distributed.rpc.rref import RRef
from aioautograd.distributed.rpc.worker import WorkerInfo, _current_agent, current_agent

WorkerRef = str | int | WorkerInfo


def _env_int(value: int | None, variables: tuple[str, ...], what: str) -> int:
    if value is not None:
        return value
    for variable in variables:
        env = os.environ.get(variable)
        if env is not None:
            return int(env)
    raise ValueError(
        f"{what} not given and none of {', '.join(variables)} is set: pass {what}=, or start "
        "the script with the launcher, which sets them: python -m aioautograd.distributed.run "
        "--nproc N script.py (or -m package.module), or with torchrun"
    )


def _default_backend() -> str:
    # A launcher (ours, torchrun, a cluster job script) that sets MASTER_PORT means processes.
    chosen = os.environ.get("AIOAUTOGRAD_RPC_BACKEND")
    if chosen:
        return chosen
    return "grpc" if os.environ.get("MASTER_PORT") else "local"


async def init_rpc(
    name: str,
    rank: int | None = None,
    world_size: int | None = None,
    backend: str | None = None,
    rpc_backend_options: RpcBackendOptions | None = None,
    *,
    options: RpcBackendOptions | None = None,
    allowed_functions: Sequence[str] = (),
) -> RpcAgent:
    """Start this worker's RPC agent and wait until all ``world_size`` workers have joined.

    The agent becomes the current worker of the calling task (a ``ContextVar``): RPC calls
    from this task, from tasks it starts later and from remote functions it executes use it.

    Args:
        name: This worker's unique name.
        rank: Its rank in ``[0, world_size)``, also its ``WorkerInfo.id`` (default: ``RANK``,
            else ``SLURM_PROCID``).
        world_size: Number of workers (default: ``WORLD_SIZE``, else ``SLURM_NTASKS``).
        backend: ``"local"`` (workers are tasks of this process and loop) or ``"grpc"``
            (processes or machines); default ``AIOAUTOGRAD_RPC_BACKEND``, else ``"grpc"``
            when ``MASTER_PORT`` is set (by a launcher), else ``"local"``.
        rpc_backend_options: :class:`LocalOptions`, :class:`GrpcOptions` or the common
            :class:`RpcBackendOptions` (``options`` is a shorter alias).
        allowed_functions: ``"module:qualname"`` entries that peers may call on this worker
            besides the ``@rpc.register``-ed functions; imported now.

    Returns:
        The started agent.

    Raises:
        RuntimeError: when the calling task already has a running agent.
        RpcError: when the other workers do not join within ``init_timeout``.
        RpcAuthenticationError: when the grpc master refuses this worker's token.
    """
    existing = _current_agent.get()
    if existing is not None and not existing.is_shut_down:
        raise RuntimeError(f"RPC is already initialised in this task as {existing.info.name!r}")
    if rpc_backend_options is not None and options is not None:
        raise TypeError("pass rpc_backend_options or options, not both")
    agent = create_agent(
        backend or _default_backend(),
        name,
        _env_int(rank, ("RANK", "SLURM_PROCID"), "rank"),
        _env_int(world_size, ("WORLD_SIZE", "SLURM_NTASKS"), "world_size"),
        rpc_backend_options or options,
        allowed_functions,
    )
    await agent.start()
    _current_agent.set(agent)
    return agent


async def shutdown(graceful: bool = True) -> None:
    """Stop the current worker.

    With ``graceful=True`` (the default) it first waits for this worker's outstanding calls,
    then for every other live worker to call ``shutdown`` too, serving their calls meanwhile:
    when it returns, no worker has work in flight that involves this one. Workers marked dead
    are not waited for. ``graceful=False`` stops at once: calls in flight fail.

    Raises:
        RpcError: when the graceful barrier times out (``shutdown_timeout``); the agent is
            stopped all the same.
    """
    await current_agent().shutdown(graceful)


def rpc_async(
    to: WorkerRef,
    fn: Callable[..., Any] | str,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> RpcFuture[Any]:
    """Send ``fn(*args, **kwargs)`` to worker ``to`` now; return a future of its result.

    As in PyTorch, the call is made when ``rpc_async`` is called (arguments encoded,
    distributed autograd records made, the default timeout read), not when the future is
    awaited. The :class:`RpcFuture` is an ``asyncio.Future``: ``await`` it, give it to
    ``asyncio.gather``, add done-callbacks, or chain with :meth:`RpcFuture.then`;
    cancelling it cancels the remote work. ``fn`` is a registered function (or
    allow-listed on the callee), or its wire name. The arguments and the result are copied
    (see ``wire`` for what may travel; no pickle). Must be called on the agent's event loop
    (from other threads, use :func:`rpc_sync`).

    Args:
        to: The worker's name, id or :class:`WorkerInfo`.
        fn: The function or its name.
        args: Positional arguments.
        kwargs: Keyword arguments.
        timeout: Seconds (default: ``options.rpc_timeout``; ``0``: none). On expiry the
            remote work is cancelled (an ``async`` function is; a plain one finishes on its
            thread, its result discarded).

    Raises (when awaited):
        RemoteError: the function raised; the error carries the original type name,
            message and worker name, and is also an instance of the original type when
            that is a built-in exception (``except ValueError`` works).
        FunctionNotRegisteredError: the callee refused ``fn`` (raised as a RemoteError too).
        RpcTimeoutError: the call took longer than ``timeout``.
        WorkerUnavailableError: the worker is unreachable, shut down or marked dead.

    Raises (at once):
        TypeError: an argument cannot travel.
        ValueError: an unknown worker.
        RuntimeError: RPC is not initialised, or the caller is not on the agent's loop.
    """
    return current_agent().call_soon(to, fn, args, kwargs, timeout)


def rpc_sync(
    to: WorkerRef,
    fn: Callable[..., Any] | str,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> Any:
    """Blocking :func:`rpc_async` for code outside the event loop.

    Meant for plain remote functions (they run on worker threads) and for threads of a
    program whose agent runs on another thread's loop.

    Raises:
        RuntimeError: when called on a thread that runs an event loop (use ``await``).
    """
    agent = current_agent()
    return agent.run_sync(agent.call, to, fn, args, kwargs, timeout)


def remote(
    to: WorkerRef,
    fn: Callable[..., Any] | str,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> RRef[Any]:
    """Run ``fn`` on ``to`` and return at once an :class:`RRef` to the result it keeps.

    The call is encoded now (as with :func:`rpc_async`) and proceeds in the background (a
    graceful ``shutdown`` waits for it); an error it raises surfaces from
    ``rref.to_here()``. Messages carrying the RRef may reach the owner before the creation
    does: the owner waits for the value. Must be called on the agent's event loop.
    """
    return current_agent().remote(to, fn, args, kwargs, timeout)


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """The :class:`WorkerInfo` of ``worker_name``, or of the current worker.

    Raises:
        ValueError: for an unknown worker name.
    """
    return current_agent().worker_info(worker_name)


def get_current_agent() -> RpcAgent:
    """The agent of the calling task (see :func:`init_rpc`)."""
    return current_agent()
