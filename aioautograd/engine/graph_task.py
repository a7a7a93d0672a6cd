"""`GraphTask`: the state of one backward pass (mirrors graph_task.h).

A graph task is started by a coroutine on the caller's event loop (or, for the ``*_sync``
twins, by a thread that waits) and then lives on the executors: workers evaluate its nodes,
count down its ``dependencies``, fill its ``not_ready`` input buffers and push ready tasks.
The worker that brings ``outstanding_tasks`` to zero signals completion once; the starter
then runs :meth:`GraphTask.exec_post_processing`: the error, the ``not_ready`` check, the
leaf streams, the final callbacks in order, and the result.

The thread boundary. The loop coordinates and is never round-tripped per node; the
executors do the math and the bookkeeping::

    caller: event loop thread                     executors: worker threads per device
    -------------------------                     ------------------------------------
    Engine.execute -> GraphTask.run
      | inline.run_inline: small CPU nodes run
      |   here, within the policy's budget   --push-->  Executor.run -> evaluate_task
      |                                                   -> evaluate_function: hooks,
      |                                                      node.apply, validate_outputs,
      |                                                      make successors ready, loop
      |                                                   (a pass's first task, plain: the
      |                                                    inline schedule, on this worker)
      | _run_async_node: awaits an async      <--start_async_node (call_soon_threadsafe)--
      |   node's apply as a task               --push_continuation-->  evaluate_function
      |   (a node without edges or hooks, and one reached inline, stays on the loop)
      | await _done_future                    <--all_tasks_done (call_soon_threadsafe)--
      | exec_post_processing: device wait in a thread, final callbacks (awaited if async)
      v result

    run_sync: the same from a blocking thread (no loop): it waits on ``_done_event``; a
    worker calling it (reentrant backward) serves its own queue meanwhile
    (``Executor.drive``), and async nodes or callbacks go to the graph task's loop.

Convention: a function at the boundary starts its docstring with where it runs: ``(loop)``,
``(executor)``, ``(executor or loop)`` (evaluation, which inline mode runs on the loop),
``(starter)`` (the loop for ``run``, the waiting thread for ``run_sync``) or ``(any)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aioautograd.anomaly_mode import AnomalyMode, _anomaly
from aioautograd.autograd.node import Edge, Node
from aioautograd.autograd.saved import describe
from aioautograd.devices.cpu_budget import cpu_budget
from aioautograd.devices.device import stash_current_streams
from aioautograd.engine.executor import pause_if_due
from aioautograd.engine.input_buffer import SlotOrder
from aioautograd.engine.loop_turns import loop_turns
from aioautograd.engine.ready_queue import DEPTH_SHIFT, NodeTask, ReadyQueue
from aioautograd.grad_mode import _grad_enabled
from aioautograd.profiler.recorder import active_profiler, current_label, profile
from aioautograd.tensor import Tensor

if TYPE_CHECKING:
    from aioautograd.devices.device import Device
    from aioautograd.devices.streams import Event, Stream
    from aioautograd.engine.engine import Engine

_ids = itertools.count(1)

# Receives ``(leaf, grad)`` in place of the leaf's ``AccumulateGrad`` (distributed autograd).
LeafHook = Callable[["Tensor", "Tensor"], None]

# The graph task whose backward is running in this context (worker thread, async node, or
# a final callback): ``queue_callback`` and nested backward attach to it.
current_graph_task: contextvars.ContextVar[GraphTask | None] = contextvars.ContextVar(
    "current_graph_task", default=None
)


def enter_graph_task(graph_task: GraphTask) -> None:
    """Make the current context run ``graph_task``'s nodes: its grad mode (``create_graph``),
    its anomaly mode and ``current_graph_task``."""
    current_graph_task.set(graph_task)
    # Set only what differs (a set costs a new context mapping; the caller's anomaly mode,
    # which a top-level task copies, and often its grad mode, are the task's already).
    if _grad_enabled.get() is not graph_task.grad_mode:
        _grad_enabled.set(graph_task.grad_mode)
    if _anomaly.get() is not graph_task.anomaly:
        _anomaly.set(graph_task.anomaly)


@dataclass(slots=True)
class ExecInfo:
    """Whether a node must run, and which of its inputs ``grad()`` captures."""

    needed: bool = False
    captures: list[tuple[int, int]] = field(default_factory=list)  # (input_nr, output_idx)

    def should_execute(self) -> bool:
        return self.needed or bool(self.captures)


class GraphTask:
    """One backward pass over a graph (see module docstring)."""

    # Slots: a graph task sets about 35 attributes per backward, and a dict-backed instance
    # paid about 1 µs more for them (the small MLP step's fixed cost).
    __slots__ = (
        "__weakref__",
        "_async_context",
        "_async_tasks",
        "_children",
        "_done_event",
        "_done_future",
        "_walk",
        "anomaly",
        "caller_streams",
        "captured_vars",
        "completed",
        "dependencies",
        "depth_key",
        "engine",
        "error",
        "exec_info",
        "fan_in",
        "final_callbacks",
        "grad_mode",
        "has_error",
        "id",
        "keep_graph",
        "label",
        "leaf_hook",
        "leaf_streams",
        "lock",
        "loop",
        "not_ready",
        "outstanding_tasks",
        "owner_queue",
        "parent",
        "pending_analysis",
        "plain",
        "profiler",
        "reentrant_depth",
        "slot_orders",
    )

    def __init__(
        self,
        engine: Engine,
        *,
        keep_graph: bool,
        create_graph: bool,
        reentrant_depth: int,
        anomaly: AnomalyMode,
        loop: asyncio.AbstractEventLoop | None,
        parent: GraphTask | None,
        leaf_hook: LeafHook | None = None,
    ) -> None:
        self.id = next(_ids)
        self.engine = engine
        self.keep_graph = keep_graph
        self.grad_mode = create_graph
        self.reentrant_depth = reentrant_depth
        self.depth_key = reentrant_depth << DEPTH_SHIFT
        self.anomaly = anomaly
        self.loop = loop
        self.parent = parent
        self.leaf_hook = leaf_hook
        self.lock = threading.Lock()
        self.outstanding_tasks = 0
        self.dependencies: dict[Node, int] = {}
        # Nodes that several edges feed -> the nodes those edges come from (one entry per
        # edge), and the summation orders built from them at a node's first gradient.
        self.fan_in: dict[Node, list[Node]] = {}
        self.slot_orders: dict[Node, list[SlotOrder | None]] = {}
        self.not_ready: dict[Node, list[Tensor | None]] = {}
        self.exec_info: dict[Node, ExecInfo] | None = None
        self.pending_analysis: tuple[Node, Sequence[Edge] | None, bool, int] | None = None
        # A dependency walk that stopped at its limit: (stack, first edges, nodes seen).
        self._walk: tuple[list[Node], dict[Node, Node], int] | None = None
        # No grad() outputs, leaf hook, anomaly mode or profiler: nodes take the hot path.
        self.plain = False
        self.captured_vars: list[Tensor | None] = []
        self.has_error = False
        self.error: BaseException | None = None
        self.final_callbacks: list[Callable[[], Any]] = []
        self.completed = False
        self.owner_queue: ReadyQueue | None = None
        self._done_future: asyncio.Future[None] | None = None
        self._done_event: threading.Event | None = None
        self._async_context: contextvars.Context | None = None
        self._async_tasks: set[asyncio.Task[None]] = set()
        # Nested passes started by this one's nodes (checkpoint): cancelled with it.
        self._children: set[GraphTask] | None = None
        if parent is not None:
            with parent.lock:
                if parent._children is None:
                    parent._children = set()
                parent._children.add(self)
        # Streams: the caller's current ones, and those of the leaves that were accumulated
        # into; joined at completion so the caller may read ``.grad`` on its own streams.
        self.caller_streams = stash_current_streams()
        self.leaf_streams: set[Stream] = set()
        recorder = active_profiler.get()
        self.profiler: profile | None = (
            recorder if recorder is not None or parent is None else parent.profiler
        )
        self.label = current_label.get() if self.profiler is not None else None

    def __repr__(self) -> str:
        return f"<GraphTask {self.id} depth={self.reentrant_depth}>"

    # ------------------------------------------------------------------ graph analysis
    def analyse(self, max_nodes: int | None = None) -> bool:
        """Run the pending graph walks (dependencies, exec_info) before the first node.

        With ``max_nodes``, give up (leaving the walks pending) on a graph that has more
        nodes, and return False.
        """
        pending = self.pending_analysis
        assert pending is not None
        root, outputs, accumulate_grad, min_topo_nr = pending
        if max_nodes is not None and root.topological_nr - min_topo_nr >= max_nodes:
            # Its longest path alone reaches the limit (a long chain): no walk to find out.
            return False
        if not self.compute_dependencies(root, min_topo_nr, max_nodes):
            return False  # (the walk so far is kept: the next analyse goes on from there)
        self.pending_analysis = None
        if outputs is not None:
            self.init_to_execute(root, outputs, accumulate_grad, min_topo_nr)
        self.plain = (
            self.exec_info is None
            and self.leaf_hook is None
            and not self.anomaly.enabled
            and self.profiler is None
        )
        return True

    def compute_dependencies(
        self, root: Node, min_topo_nr: int, max_nodes: int | None = None
    ) -> bool:
        """Count, for each node reachable from ``root``, the edges that lead into it, and
        note where the edges into nodes fed by several come from (``fan_in``).

        Returns False, with the counts incomplete, once ``max_nodes`` are seen: the walk
        is kept, and the next call (on an executor, without a limit) goes on with it, so
        that a graph too large to run inline is not walked twice.
        """
        dependencies = self.dependencies
        fan_in = self.fan_in
        first: dict[Node, Node]  # each node seen -> the node of its first edge
        if self._walk is None:
            first = {}
            stack = [root]
            seen = 0
        else:  # an earlier walk gave up at its limit (on the loop): go on from there
            stack, first, seen = self._walk
            self._walk = None
        limit = max_nodes if max_nodes is not None else sys.maxsize
        # One comparison per node: the next count of nodes seen at which to check the
        # limit and let other threads in (every 1,024 nodes).
        check_at = min(limit, seen + 1024)
        push = stack.append
        pop = stack.pop
        # (Membership tests and subscripts, not dict.get: no method call per edge.)
        while stack:
            node = pop()
            for next_node, _ in node._next_edges:
                if next_node is None or (min_topo_nr and next_node.topological_nr < min_topo_nr):
                    continue
                if next_node in dependencies:
                    # A node fed by several edges: its count is its producers' (below).
                    if next_node in fan_in:
                        fan_in[next_node].append(node)
                    else:
                        fan_in[next_node] = [first[next_node], node]
                else:
                    dependencies[next_node] = 1
                    first[next_node] = node
                    push(next_node)
                    seen += 1
            if seen >= check_at:  # (after the node's last edge: the walk can go on)
                if seen >= limit:
                    self._walk = (stack, first, seen)
                    return False
                pause_if_due()
                check_at = min(limit, seen + 1024)
        for next_node, producers in fan_in.items():
            dependencies[next_node] = len(producers)
        return True

    def init_to_execute(
        self, root: Node, outputs: Sequence[Edge], accumulate_grad: bool, min_topo_nr: int
    ) -> None:
        """Build ``exec_info``: only nodes on a path from ``root`` to an output edge run."""
        exec_info: dict[Node, ExecInfo] = {}
        for output_idx, (node, input_nr) in enumerate(outputs):
            assert node is not None
            info = exec_info.get(node)
            if info is None:
                info = exec_info[node] = ExecInfo()
            if accumulate_grad:
                # backward(inputs=...): the input's node runs (its hooks too); a non-leaf's
                # gradient reaches .grad through retain_grad, as in PyTorch.
                info.needed = True
            else:
                info.captures.append((input_nr, output_idx))
        self.captured_vars = [None] * len(outputs)

        # Iterative post-order DFS: a node is needed if any child should execute.
        visited = {root}
        stack: list[tuple[Node, Any]] = [(root, iter(root._next_edges))]
        while stack:
            node, children = stack[-1]
            descended = False
            for child, _ in children:
                if child is None or child.topological_nr < min_topo_nr or child in visited:
                    continue
                visited.add(child)
                stack.append((child, iter(child._next_edges)))
                descended = True
                break
            if descended:
                continue
            stack.pop()
            for child, _ in node._next_edges:
                child_info = exec_info.get(child) if child is not None else None
                if child_info is not None and child_info.should_execute():
                    info = exec_info.get(node)
                    if info is None:
                        info = exec_info[node] = ExecInfo()
                    info.needed = True
                    break
        self.exec_info = exec_info

    # --------------------------------------------------------------------- completion
    def task_finished(self) -> None:
        """(executor or loop) Account for one task that ended without producing successors
        (error, skip, or a leaf's AccumulateGrad)."""
        with self.lock:
            self.outstanding_tasks -= 1
            done = self.outstanding_tasks == 0
        if done:
            self.all_tasks_done()

    def all_tasks_done(self) -> None:
        """(executor or loop) Called once, by whoever brought ``outstanding_tasks`` to zero (or
        by ``abort``): wakes the starter."""
        self.completed = True
        parent = self.parent
        if parent is not None and parent._children is not None:
            with parent.lock:
                parent._children.discard(self)
        if self._done_event is not None:
            self._done_event.set()
        if self.owner_queue is not None:
            self.owner_queue.wake_all()
        loop = self.loop
        if self._done_future is not None and loop is not None:
            if asyncio._get_running_loop() is loop:  # finished on the loop (an async node)
                self._resolve_done()
                return
            # RuntimeError: the caller's loop is closed, so nobody is waiting any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._resolve_done)

    def _resolve_done(self) -> None:
        future = self._done_future
        if future is not None and not future.done():
            future.set_result(None)

    def wait_completed(self) -> None:
        event = self._done_event
        assert event is not None
        event.wait()

    def set_error(
        self,
        exc: BaseException,
        node: Node | None,
        device: Device | None,
        inputs: Sequence[Tensor | None] | None,
    ) -> None:
        """(any) Fail the graph task with ``exc`` (first error wins); later nodes will not
        run, and running async nodes are cancelled on the loop."""
        with self.lock:
            if self.has_error:
                return
            self.has_error = True
            self.error = exc
        if node is not None and not isinstance(exc, asyncio.CancelledError):
            # A note that cannot be added (``__notes__`` set to None...) must not lose the error.
            with contextlib.suppress(Exception):
                _annotate(exc, self, node, device, inputs)
        if self.loop is not None and self._async_tasks:
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self._cancel_async_nodes)

    def abort(self, exc: BaseException) -> None:
        """Fail the graph task with ``exc`` and complete it now, whatever its count of
        outstanding tasks (an error escaped the engine's own bookkeeping: the count cannot
        be trusted, and the caller must get the error rather than wait forever)."""
        self.set_error(exc, None, None, None)
        if not self.completed:
            self.all_tasks_done()

    def cancel(self) -> None:
        """Stop the pass: no node of it (or of a nested pass it started) starts any more,
        and its ``async`` nodes are cancelled. A node already running finishes in the
        background; nobody waits for it."""
        self.set_error(asyncio.CancelledError(), None, None, None)  # cancels async nodes
        with self.lock:
            children = tuple(self._children) if self._children else ()
        for child in children:
            child.cancel()

    def _cancel_async_nodes(self) -> None:
        for task in tuple(self._async_tasks):
            task.cancel()

    # -------------------------------------------------------------------- async nodes
    def start_async_node(self, node: Node, inputs: list[Tensor | None]) -> None:
        """(executor or loop) Run an ``async`` node's ``apply`` as a task on the graph task's
        event loop (at once when called there: inline mode reaches async nodes on the loop)."""
        loop = self.loop
        assert loop is not None
        if asyncio._get_running_loop() is loop:
            self._create_async_node_task(node, inputs)
        else:
            loop.call_soon_threadsafe(self._create_async_node_task, node, inputs)

    def _create_async_node_task(self, node: Node, inputs: list[Tensor | None]) -> None:
        """(loop)"""
        if self.has_error:
            self.task_finished()
            return
        context = self._async_context
        assert context is not None
        assert self.loop is not None
        task = self.loop.create_task(self._run_async_node(node, inputs), context=context.copy())
        self._async_tasks.add(task)
        task.add_done_callback(self._async_tasks.discard)

    async def _run_async_node(self, node: Node, inputs: list[Tensor | None]) -> None:
        """(loop) Await the node, then hand its outputs back to an executor."""
        try:
            outputs = await node.apply(inputs)  # type: ignore[misc]
        except BaseException as exc:  # includes CancelledError: the task is over either way
            # KeyboardInterrupt and the like too: raised here they would stop the event loop
            # (every other pass on it with it); they are the awaiting caller's to handle.
            self.set_error(exc, node, None, inputs)
            self.task_finished()
            return
        if not node._next_edges and not node._post_hooks:
            # Nothing to validate, hook or make ready (e.g. distributed autograd's
            # RecvRpcBackward): account for the task here rather than hand an executor a
            # task whose only work is this count (two thread wake-ups).
            if not self.keep_graph:
                node.release_variables()
            self.task_finished()
            return
        # Validation, hooks and bookkeeping happen on an executor, never on the loop.
        self.engine.push_continuation(NodeTask(self, node, [], outputs))

    # ------------------------------------------------------------------------ running
    async def run(self, first: NodeTask, device: Device) -> list[Tensor | None]:
        """(loop) Start (inline while cheap, see engine/inline.py, else on the executors),
        await completion, then run the post-processing."""
        loop = self.loop
        assert loop is not None
        context = self._prepare_async_context()
        self.outstanding_tasks = 1
        budget = self.engine.policy.inline_budget_s
        if budget > 0 and device.type == "cpu" and self.parent is None:
            completed = context.run(_run_inline or _load_run_inline(), self, first, budget)
        else:
            self._done_future = loop.create_future()
            self.engine.push(first, device)
            completed = False
        try:
            if not completed:
                await self._done_future  # type: ignore[misc]
                await loop_turns(loop).take_turn()
                if device.type == "cpu":
                    cpu_budget().hold_for_turn(loop)
        except asyncio.CancelledError:
            # Prompt: the tasks left are dropped by the workers as they pop them.
            self.cancel()
            self._async_context = None
            raise
        if self.error is None and not self.not_ready and self._nothing_to_post_process():
            self._release()
            return self.captured_vars
        post = self.exec_post_processing()
        try:
            for pending in post:
                if isinstance(pending, list):  # device events
                    if not _finished_soon(pending):
                        # Wait for the device through a thread: the loop keeps serving.
                        await asyncio.to_thread(_synchronize, pending)
                else:
                    await pending
        finally:
            post.close()
            self._release()
        return self.captured_vars

    def _nothing_to_post_process(self) -> bool:
        """(starter, after completion) No leaf stream to join and no final callback: the
        common case skips ``exec_post_processing`` (a generator and a context switch). No
        lock: every node has finished, so nothing adds to either any more."""
        return not self.leaf_streams and not self.final_callbacks

    def run_sync(self, first: NodeTask, device: Device) -> list[Tensor | None]:
        """(starter: a thread without a running event loop) Blocking twin of :meth:`run`."""
        from aioautograd.engine.executor import worker_state

        self._done_event = threading.Event()
        self._prepare_async_context()
        self.outstanding_tasks = 1
        executor = worker_state.executor
        self.engine.push(first, device)
        if executor is not None:
            executor.drive(self)  # reentrant: serve our own queue while we wait
        self._done_event.wait()
        post = self.exec_post_processing()
        try:
            for pending in post:
                if isinstance(pending, list):  # device events
                    _synchronize(pending)
                else:
                    self._await_from_thread(pending)
        finally:
            post.close()
            self._release()
        return self.captured_vars

    def exec_post_processing(
        self,
    ) -> Generator[list[Event] | Coroutine[Any, Any, Any], None, None]:
        """(starter) What follows completion, for :meth:`run` and :meth:`run_sync` alike
        (PyTorch's ``GraphTask::exec_post_processing``): raise the graph task's error, check
        that every node got all its inputs, join the leaf streams into the caller's, then run
        the final callbacks in order, each popped under the lock (a callback may queue
        another), with this graph task current.

        A generator: it yields what the starter must wait for in its own way, the device
        events (a list) and the coroutines async final callbacks return. The starter closes
        it when done (``finally``), in its own context.
        """
        if self.error is not None:
            raise self.error
        self._check_not_ready()
        events = self._join_leaf_streams()
        if events:
            yield events
        token = current_graph_task.set(self)
        try:
            while True:
                with self.lock:
                    if not self.final_callbacks:
                        break
                    callback = self.final_callbacks.pop(0)
                result = callback()
                if asyncio.iscoroutine(result):
                    yield result
        finally:
            current_graph_task.reset(token)

    def _release(self) -> None:
        """Drop what the finished pass holds (buffers of nodes that never became ready,
        the walks' tables, its context) so that nothing outlives it, even while a
        reference to the graph task itself remains (a traceback, say)."""
        self.not_ready = {}
        self.dependencies = {}
        self.fan_in = {}
        self.slot_orders = {}
        self.exec_info = None
        self._walk = None
        self._async_context = None

    def _await_from_thread(self, coroutine: Any) -> None:
        loop = self.loop
        if loop is not None and loop.is_running():
            asyncio.run_coroutine_threadsafe(coroutine, loop).result()
        else:
            asyncio.run(coroutine)

    def _join_leaf_streams(self) -> list[Event]:
        """Make the caller's streams wait for the leaf streams; return events to await."""
        if not self.leaf_streams:
            return []
        joined: dict[Device, Stream] = {}
        for leaf in self.leaf_streams:
            caller = self.caller_streams.get(leaf.device)
            if caller is not None:
                caller.wait_stream(leaf)
                joined[leaf.device] = caller
        return [caller.record_event() for caller in joined.values()]

    def expect_completion_elsewhere(self) -> None:
        """Make a future for the executors to resolve (before handing them a task)."""
        if self._done_future is None and self.loop is not None:
            self._done_future = self.loop.create_future()

    @property
    def caller_context(self) -> contextvars.Context | None:
        """A copy of the context of the task that started this pass (``None`` until it
        starts): layers above the engine read their ``ContextVar`` s there from nodes that
        run on executor threads (e.g. the RPC worker of a ``Function.backward``)."""
        return self._async_context

    def _prepare_async_context(self) -> contextvars.Context:
        context = contextvars.copy_context()
        context.run(enter_graph_task, self)
        self._async_context = context
        return context

    def _check_not_ready(self) -> None:
        if self.not_ready:
            names = ", ".join(sorted({node.name() for node in self.not_ready}))
            raise RuntimeError(
                "could not compute gradients for some functions: "
                f"{names} never received all their inputs"
            )


_run_inline: Callable[[GraphTask, NodeTask, float], bool] | None = None


def _load_run_inline() -> Callable[[GraphTask, NodeTask, float], bool]:
    # inline.py imports this module (through evaluate.py): bound on first use, because an
    # import statement inside ``run`` cost ~8k instructions per backward (callgrind).
    global _run_inline
    from aioautograd.engine.inline import run_inline

    _run_inline = run_inline
    return run_inline


def _annotate(
    exc: BaseException,
    graph_task: GraphTask,
    node: Node,
    device: Device | None,
    inputs: Sequence[Tensor | None] | None,
) -> None:
    described = ", ".join(_describe_value(grad) for grad in (inputs or ()))
    where = f" on device {device}" if device is not None else ""
    exc.add_note(
        f"Raised by {node.name()} in graph task {graph_task.id}{where}; "
        f"its gradient inputs were: [{described}]"
    )
    current: Node | None = node
    induced = False
    while current is not None:
        metadata = current._metadata or {}
        trace = metadata.get("traceback_")
        if trace:
            what = "induced the previous calculation" if induced else "caused the error"
            if induced:
                exc.add_note(f"Previous calculation was induced by {current.name()}.")
            exc.add_note(
                f"Traceback of forward call that {what} ({current.name()}, anomaly mode):\n"
                + "".join(trace).rstrip()
            )
        current = metadata.get("parent_")
        induced = True


def _describe_value(value: object) -> str:
    """``describe`` for what a buffer slot holds; a hook may have put anything there."""
    if value is None:
        return "None"
    if isinstance(value, Tensor):
        return describe(value)
    return f"<{type(value).__name__}, not a Tensor>"


# After a backward on an accelerator the loop polls its completion events this long before
# it hands the wait to a thread: the device is usually that close to done, and a thread
# round trip cost ~120 µs on the machine of benchmarks/README.md's GPU figures (gpu_mlp).
COMPLETION_POLL_S = 50e-6


def _finished_soon(events: list[Event]) -> bool:
    """Whether every event completes within ``COMPLETION_POLL_S`` (runs on the loop)."""
    deadline = time.perf_counter() + COMPLETION_POLL_S
    while not all(event.query() for event in events):
        if time.perf_counter() > deadline:
            return False
    return True


def _synchronize(events: list[Event]) -> None:
    for event in events:
        event.synchronize()
