"""`Engine`: builds graph tasks and owns the per-device executors (mirrors engine.cpp)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

from aioautograd._asyncio import ensure_no_running_loop
from aioautograd.anomaly_mode import _anomaly
from aioautograd.autograd.node import Edge, GraphRoot, Node
from aioautograd.devices.cpu_budget import configure as configure_cpu_budget
from aioautograd.devices.cpu_budget import usable_cores
from aioautograd.devices.device import CPU, Device
from aioautograd.devices.thread_slice import enter_short_slice, leave_short_slice
from aioautograd.engine.executor import Executor, OffloadedCall
from aioautograd.engine.graph_task import GraphTask, LeafHook, current_graph_task
from aioautograd.engine.input_buffer import buffer_device
from aioautograd.engine.policy import EnginePolicy
from aioautograd.engine.ready_queue import NodeTask
from aioautograd.engine.validate import validate_outputs
from aioautograd.tensor import Tensor

T = TypeVar("T")


def _default_cpu_threads() -> int:
    return max(2, min(8, usable_cores()))


class Engine:
    """Runs backward passes: any number of graph tasks at once, from any loops or threads.

    Each device has one executor: CPU work runs on a pool of worker threads, each CUDA
    device on its own thread. The event loop starts graph tasks, runs ``async`` nodes and
    completes futures; it does tensor math only for the small nodes of an awaited backward
    that fits the policy's inline budget. How the engine uses the machine (threads, the CPU
    budget shared with BLAS, nice level, inline budget, GIL pauses) is its
    :class:`EnginePolicy`; the keyword arguments are shortcuts for its fields.

    Use :func:`get_default_engine` (or install one with :func:`set_default_engine`) unless
    you need an isolated engine.
    """

    _default: ClassVar[Engine | None] = None
    _default_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(
        self,
        policy: EnginePolicy | None = None,
        *,
        num_cpu_threads: int | None = None,
        inline_budget_s: float | None = None,
        worker_nice: int | None = None,
    ) -> None:
        policy = policy if policy is not None else EnginePolicy()
        overrides: dict[str, Any] = {}
        if num_cpu_threads is not None:
            overrides["cpu_threads"] = num_cpu_threads
        if inline_budget_s is not None:
            overrides["inline_budget_s"] = inline_budget_s
        if worker_nice is not None:
            overrides["worker_nice"] = worker_nice
        self.policy = dataclasses.replace(policy, **overrides) if overrides else policy
        self._executors: dict[Device, Executor] = {}
        self._executors_lock = threading.Lock()

    @property
    def num_cpu_threads(self) -> int:
        """CPU executor worker threads (the policy's ``cpu_threads``, or the default)."""
        return self.policy.cpu_threads or _default_cpu_threads()

    @property
    def inline_budget_s(self) -> float:
        return self.policy.inline_budget_s

    @inline_budget_s.setter
    def inline_budget_s(self, value: float) -> None:
        self.policy = dataclasses.replace(self.policy, inline_budget_s=value)

    @classmethod
    def get_default_engine(cls) -> Engine:
        """The process-wide engine used by ``backward``, ``grad`` and ``offload``."""
        engine = cls._default
        if engine is None:
            with cls._default_lock:
                engine = cls._default
                if engine is None:
                    engine = cls._default = Engine()
        return engine

    @classmethod
    def set_default_engine(cls, engine: Engine) -> Engine | None:
        """Make ``engine`` the one ``backward``, ``grad`` and ``offload`` use; return the
        previous one (which keeps serving the passes already running on it).

        The new engine's policy also configures the process's CPU budget.
        """
        with cls._default_lock:
            previous = cls._default
            cls._default = engine
        configure_cpu_budget(engine.policy)
        return previous

    def close(self) -> None:
        """Stop this engine's worker threads once their queues are empty.

        Call it on an engine that no backward pass uses any more (not the default one).
        """
        for executor in self.executors.values():
            executor.close()

    # ---------------------------------------------------------------------- executors
    def executor(self, device: Device) -> Executor:
        """The executor serving ``device`` (created on first use)."""
        executor = self._executors.get(device)
        if executor is None:
            with self._executors_lock:
                executor = self._executors.get(device)
                if executor is None:
                    threads = self.num_cpu_threads if device.type == "cpu" else 1
                    executor = self._executors[device] = Executor(self, device, threads)
        return executor

    @property
    def executors(self) -> dict[Device, Executor]:
        return dict(self._executors)

    def push(self, task: NodeTask, device: Device, wake: bool = True) -> None:
        self.executor(device).push(task, wake)

    def push_continuation(self, task: NodeTask) -> None:
        """Hand the outputs of an async node back to an executor for bookkeeping."""
        outputs = task.outputs or ()
        self.push(task, buffer_device(list(outputs)))

    def dispatch(self, ready: list[NodeTask], device: Device) -> NodeTask | None:
        """Push ready tasks to their devices' queues, keeping at most one to run here next.

        The kept task is the highest-priority one for ``device``, and only if nothing of
        higher priority already waits in this device's queue (so ordering matches a pop).
        Tasks for ``device`` itself wake no other thread: as PyTorch runs a graph task's CPU
        work on one thread, this one pops them when it is done (a graph of small nodes spread
        over two threads mostly trades the GIL back and forth); threads already awake, or
        woken for another graph task, take them too.
        """
        # This thread serves ``device``'s executor (its workers are started): its queue
        # takes the local tasks directly.
        queue = self.executor(device).queue
        local: NodeTask | None = None
        for task in ready:
            task_device = buffer_device(task.inputs)
            if task_device is device and (local is None or task.key > local.key):
                if local is not None:
                    queue.push(local, wake=False)
                local = task
            elif task_device is device:
                queue.push(task, wake=False)
            else:
                self.push(task, task_device)
        if local is not None:
            top = queue.top_key()
            if top is not None and top > local.key:
                queue.push(local, wake=False)
                return None
        return local

    # ---------------------------------------------------------------------- execution
    def _make_graph_task(
        self,
        roots: Sequence[Edge],
        grads: Sequence[Tensor | None],
        keep_graph: bool,
        create_graph: bool,
        accumulate_grad: bool,
        outputs: Sequence[Edge] | None,
        loop: asyncio.AbstractEventLoop | None,
        leaf_hook: LeafHook | None = None,
    ) -> tuple[GraphTask, NodeTask, Device]:
        checked = validate_outputs(roots, grads, "backward")
        parent = current_graph_task.get()
        graph_task = GraphTask(
            self,
            keep_graph=keep_graph,
            create_graph=create_graph,
            reentrant_depth=0 if parent is None else parent.reentrant_depth + 1,
            anomaly=_anomaly.get(),
            loop=loop if loop is not None else (parent.loop if parent is not None else None),
            parent=parent,
            leaf_hook=leaf_hook,
        )
        for (node, _), grad in zip(roots, checked, strict=True):
            # The root gradient was made on the caller's stream; the root node runs on its own.
            if grad is not None and node is not None and node._stream is not None:
                caller = graph_task.caller_streams.get(grad.device)
                if caller is not None:
                    node._stream.wait_stream(caller)
        root: Node
        single, input_nr = roots[0] if len(roots) == 1 else (None, 0)
        if single is not None:
            # One root: start at its node directly (PyTorch skips the dummy GraphRoot too).
            root = single
            buffer: list[Tensor | None] = [None] * len(root._input_metadata)
            buffer[input_nr] = checked[0]
            first = NodeTask(graph_task, root, buffer)
        else:
            root = GraphRoot(tuple(roots), checked)
            first = NodeTask(graph_task, root, [])
        min_topo_nr = (
            min((e[0].topological_nr for e in outputs if e[0]), default=0) if (outputs) else 0
        )
        # The graph walks run on the executor with the first task, not on the event loop.
        graph_task.pending_analysis = (root, outputs, accumulate_grad, min_topo_nr)
        return graph_task, first, buffer_device(list(checked))

    async def execute(
        self,
        roots: Sequence[Edge],
        inputs: Sequence[Tensor | None],
        keep_graph: bool,
        create_graph: bool,
        accumulate_grad: bool,
        outputs: Sequence[Edge] | None = None,
        *,
        leaf_hook: LeafHook | None = None,
    ) -> list[Tensor | None]:
        """Run a backward pass from ``roots`` seeded with ``inputs`` (their gradients).

        With ``outputs``, only the nodes on a path to them run and the gradients flowing
        into them are returned (``grad()``); with ``accumulate_grad`` leaves accumulate into
        ``.grad``, or are handed to ``leaf_hook(leaf, grad)`` instead when it is given
        (distributed autograd accumulates into its context that way; ``.grad`` stays
        untouched). Cancelling the awaiting task cancels the graph task.
        """
        loop = asyncio.get_running_loop()
        graph_task, first, device = self._make_graph_task(
            roots, inputs, keep_graph, create_graph, accumulate_grad, outputs, loop, leaf_hook
        )
        return await graph_task.run(first, device)

    def execute_sync(
        self,
        roots: Sequence[Edge],
        inputs: Sequence[Tensor | None],
        keep_graph: bool,
        create_graph: bool,
        accumulate_grad: bool,
        outputs: Sequence[Edge] | None = None,
    ) -> list[Tensor | None]:
        """Blocking twin of :meth:`execute`; refuses to run on an event loop's thread."""
        ensure_no_running_loop(
            "backward_sync/grad_sync",
            "`await tensor.backward()` / `await aioautograd.backward(...)` / "
            "`await aioautograd.grad(...)`",
        )
        graph_task, first, device = self._make_graph_task(
            roots, inputs, keep_graph, create_graph, accumulate_grad, outputs, None
        )
        return graph_task.run_sync(first, device)

    async def offload(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on this engine's CPU executor and return its result.

        The way to keep a whole training step off the event loop: forward, loss,
        ``backward_sync`` (which runs on the same executor, reentrantly, as a node's nested
        backward does) and ``optimizer.step()``. ``fn`` runs in a copy of the caller's
        context (grad mode, anomaly mode, current RPC worker...), on a worker thread that
        counts against the CPU budget, so concurrent steps share the cores with the
        engine's backward passes instead of oversubscribing them. Calls start in order,
        after every node already queued.

        Cancelling the awaiting task skips a call that has not started; one that has
        started finishes in the background and its result is dropped.

        Example::

            def step(x, y):
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward_sync()
                optimizer.step()
                return loss.item()

            loss = await aioautograd.offload(step, x, y)
        """
        call = OffloadedCall(fn, args, kwargs, asyncio.get_running_loop())
        short_slice = enter_short_slice(self.policy.loop_slice_s)
        try:
            self.executor(CPU).queue.push_call(call)
            self.executor(CPU).ensure_started()
            result: T = await call.future
            return result
        except asyncio.CancelledError:
            call.cancelled = True
            raise
        finally:
            if short_slice:
                leave_short_slice()

    @staticmethod
    def queue_callback(callback: Callable[[], Any]) -> None:
        """Run ``callback`` (plain or ``async``) when the current backward pass completes.

        Callable only during backward (from a node, a hook, or another callback). Callbacks
        run in the order they were queued, and all have finished before ``await backward()``
        returns.
        """
        graph_task = current_graph_task.get()
        if graph_task is None:
            raise RuntimeError(
                "Final callbacks can only be installed during backward pass "
                "(call queue_callback from a backward node, a hook or another callback)."
            )
        with graph_task.lock:
            graph_task.final_callbacks.append(callback)


def get_default_engine() -> Engine:
    """The process-wide default :class:`Engine`."""
    return Engine.get_default_engine()


def set_default_engine(engine: Engine) -> Engine | None:
    """Shortcut for :meth:`Engine.set_default_engine`.

    Example::

        aioautograd.set_default_engine(Engine(EnginePolicy(worker_nice=0)))
    """
    return Engine.set_default_engine(engine)


async def offload(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Shortcut for :meth:`Engine.offload` on the default engine."""
    return await Engine.get_default_engine().offload(fn, *args, **kwargs)


def queue_callback(callback: Callable[[], Any]) -> None:
    """Shortcut for :meth:`Engine.queue_callback`."""
    Engine.queue_callback(callback)
