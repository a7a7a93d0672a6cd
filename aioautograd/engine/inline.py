"""Inline execution (on by default, ``EnginePolicy.inline_budget_s``, 0.5 ms): small CPU
backward passes run on the thread that awaits them (event loop side).

Handing a graph task to an executor thread and waking the event loop when it is done costs
two thread wake-ups (about 40 µs each on a small VM), more than a dozen small nodes take to
run (the small MLP step: 352 µs inline, 643 µs on the executors). So ``GraphTask.run`` first
runs CPU nodes itself, on the event loop's thread, while they are cheap: nodes of built-in
ops (``Node.inline``) without user hooks, in a graph of at most ``inline_max_nodes`` nodes,
within the policy's ``inline_budget_s`` (the loop's latency budget; 0 keeps all tensor math
off the loop). A node's cost is predicted from its shapes: an element-wise node's by the
elements of the gradients it reads and writes (``inline_max_elements``), each counted
several times for a node far dearer per element than a multiplication (GELU's error
function, indexing's scatter-add: ``Node._element_cost``), and a matrix product's
(``Node._product_axes``: matmul, linear) also by its flops (``inline_max_flops``), so that
a 600x64 layer's backward runs here while the ``mlp`` step's products stay on the
executors. The first node that does not qualify, or the budget running out, hands every
task left to the executors, and the coroutine then awaits as usual. The loop is therefore
never blocked for longer than the budget plus one small node, and a large backward runs on
the executors from its first node. In a plain graph task (no anomaly mode, profiler,
``grad()``/``inputs=`` outputs or leaf hook) the plain nodes run in a schedule
(``_run_schedule``): the ready queue's order, latest-created first, without the queue's
per-node bookkeeping. A plain pass too large to start here runs in the same schedule on the
executor thread that takes its first task (``schedule_on_executor``).
"""

from __future__ import annotations

import contextvars
import heapq
import math
import time
from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Final

import numpy

from aioautograd.autograd.node import INLINE, PRICED, AccumulateGrad
from aioautograd.devices.device import CPU
from aioautograd.engine.evaluate import (
    _NO_INPUTS,
    _current_graph_task_get,
    complete_buffer,
    evaluate_function,
    hold,
)
from aioautograd.engine.executor import schedule_deadline, schedule_pause
from aioautograd.engine.graph_task import enter_graph_task
from aioautograd.engine.input_buffer import buffer_device
from aioautograd.engine.policy import NUMPY_ERRORS
from aioautograd.engine.ready_queue import NodeTask
from aioautograd.engine.validate import _conform, conformed, validated
from aioautograd.tensor import Tensor

if TYPE_CHECKING:
    from aioautograd.autograd.node import Node
    from aioautograd.engine.engine import Engine
    from aioautograd.engine.graph_task import GraphTask

try:  # NumPy 2: the error state is this context variable (1.26 keeps it per thread)
    from numpy._core._ufunc_config import (  # type: ignore[attr-defined,unused-ignore]
        _extobj_contextvar as _numpy_error_state,
    )
except ImportError:  # pragma: no cover (NumPy 1.26)
    _numpy_error_state = None
# (the caller's NumPy error state, the same with NUMPY_ERRORS): ``numpy.errstate`` costs
# ~9k instructions per inline pass (an object, Python __enter__/__exit__, the state built
# anew), a cached state set and reset ~1k. Keyed by the caller's state object (held here,
# so its identity cannot be reused): its buffer size and error callback are kept.
_inline_error_state: tuple[Any, Any] | None = None


def _enter_numpy_errors() -> contextvars.Token[Any]:
    """Set NumPy's error state to ``NUMPY_ERRORS`` (NumPy 2); reset with the token."""
    global _inline_error_state
    assert _numpy_error_state is not None
    caller = _numpy_error_state.get()
    cached = _inline_error_state
    if cached is None or cached[0] is not caller:
        with numpy.errstate(all=NUMPY_ERRORS):
            cached = (caller, _numpy_error_state.get())
        _inline_error_state = cached
    token: contextvars.Token[Any] = _numpy_error_state.set(cached[1])
    return token


def qualifies(node: Node, inputs: list[Tensor | None], max_elements: int, max_flops: float) -> bool:
    """Whether ``node`` may run inline on the gradients ``inputs`` (its task's): library code
    only, CPU, no user hooks, small."""
    if node._plain != INLINE:  # (one slot read for the common case: see Node._plain)
        if node._plain == PRICED:
            return _priced_qualifies(node, inputs, max_elements, max_flops)
        verdict = _hooked_verdict(node, inputs)
        if verdict is not None:
            return verdict
        if type(node)._plain == PRICED:  # (a priced node whose only extra is retain_grad)
            return _priced_qualifies(node, inputs, max_elements, max_flops)
    elif type(node) is AccumulateGrad:
        grad = inputs[0]  # (a leaf's node has one input)
        return grad is None or (grad.device.type == "cpu" and grad.data.size <= max_elements)
    elements = node._elements  # (counted at the node's creation, or negative)
    if elements >= 0:
        return elements <= max_elements
    return _elementwise_fits(node, inputs, max_elements)


def _elementwise_fits(node: Node, inputs: list[Tensor | None], max_elements: int) -> bool:
    """``qualifies`` for a node priced by its elements (not a leaf's): on the CPU, and the
    gradients it reads and writes have at most ``max_elements`` elements."""
    size = 0
    for grad in inputs:
        if grad is not None:
            if grad.device.type != "cpu":
                return False
            size += grad.data.size
    for next_node, input_nr in node._next_edges:
        if next_node is not None:
            if type(next_node) is AccumulateGrad:  # its metadata is the leaf's
                size += next_node._ref().data.size
            else:
                size += math.prod(next_node._input_metadata[input_nr][0])
    return size <= max_elements


def _priced_qualifies(
    node: Node, inputs: list[Tensor | None], max_elements: int, max_flops: float
) -> bool:
    """``qualifies`` for a node whose class prices itself (``Node._plain == PRICED``): its
    gradients' elements, each counted ``Node._element_cost`` times, and for a matrix
    product (``Node._product_axes``) the flops of its products (``_product_flops``) counted
    as float32 operations."""
    size = node._elements  # (counted at the node's creation, or negative)
    if size >= 0:
        if size * node._element_cost > max_elements:
            return False
        if node._product_axes is None:
            return True
        # (a product's node has one output: its gradient is the one the node reads)
        shape, dtype, _ = node._input_metadata[0]
        grad_size = math.prod(shape)
    else:
        size = 0
        data = None
        for grad in inputs:
            if grad is not None:
                if grad.device.type != "cpu":
                    return False
                data = grad.data
                size += data.size
        grad_size = size  # (a product's node has one input: its result's gradient)
        for next_node, input_nr in node._next_edges:
            if next_node is not None:
                if type(next_node) is AccumulateGrad:
                    size += next_node._ref().data.size
                else:
                    size += math.prod(next_node._input_metadata[input_nr][0])
        if size * node._element_cost > max_elements:
            return False
        if node._product_axes is None or data is None:
            return True
        dtype = data.dtype
    cost = _FLOP_COST.get(dtype.char, _NO_BLAS_FLOP_COST)
    # A contracted size is at most its operand's size: this bound settles small products
    # (a small MLP's) without reading the shapes.
    if 2 * grad_size * (size - grad_size) * cost <= max_flops:
        return True
    return _product_flops(node, grad_size) * cost <= max_flops


def _product_flops(node: Node, grad_size: int) -> int:
    """The flops of a product node's backward: each operand gradient it computes is one
    product of ``2 * |grad| * k`` flops, ``k`` the contracted size read from the operand's
    shape: ``grad @ b.mT`` and ``a.mT @ grad`` for ``a @ b`` (batch dimensions included,
    broadcast ones too: they are summed after the product), ``grad @ weight`` and
    ``grad.mT @ input`` for ``linear``."""
    axes = node._product_axes
    assert axes is not None
    edges = node._next_edges
    # A node with edges for some arguments only names each edge's argument (function.py).
    edge_args: tuple[int, ...] | None = (
        None if len(edges) == len(axes) else getattr(node, "_edge_args")  # noqa: B009
    )
    contracted = 0
    index = -1  # (a counter, not enumerate or zip: nothing allocated per node)
    for next_node, input_nr in edges:
        index += 1
        axis = axes[index if edge_args is None else edge_args[index]]
        if next_node is None or axis is None:
            continue  # no gradient wanted, or not a product (a bias's sum)
        if type(next_node) is AccumulateGrad:
            shape = next_node._ref().data.shape
        else:
            shape = next_node._input_metadata[input_nr][0]
        if shape:
            contracted += shape[axis if len(shape) >= -axis else 0]
    return 2 * grad_size * contracted


# What one floating-point operation of a NumPy matrix product costs in float32 operations,
# by dtype (OpenBLAS on one core of the VM of benchmarks/README.md, session 27: float64 ran
# at half float32's rate, complex64 at ~3.3x its time, complex128 ~7x); a dtype without a
# BLAS kernel (float16, longdouble: NumPy's own loops) ran ~250x slower.
_FLOP_COST: Final = {"f": 1.0, "d": 2.0, "F": 4.0, "D": 8.0}  # by ``dtype.char``
_NO_BLAS_FLOP_COST: Final = 256.0


def _hooked_verdict(node: Node, inputs: list[Tensor | None]) -> bool | None:
    """``qualifies`` for a node that is not plain library code (a hook, retain_grad, a
    stream, an async apply, or a user Function): the answer, or None when only its size
    decides (a built-in op's node whose only extra is retain_grad)."""
    if node._plain or node._stream is not None or node._pre_hooks or node._post_hooks:
        return False  # (plain but not INLINE: a user Function's node)
    if type(node) is AccumulateGrad:  # the leaf has a hook or a post-accumulate hook
        return False
    tensor_hooks = node._tensor_pre_hooks
    if tensor_hooks and any(tensor_hooks.values()):
        return False
    if not node.inline:
        # An async node's apply runs on the loop anyway: started from here, it skips the
        # hand-over to an executor and back (two thread wake-ups); the graph task
        # completes elsewhere.
        return node.is_async and all(grad is None or grad.device.type == "cpu" for grad in inputs)
    return None


def run_inline(graph_task: GraphTask, first: NodeTask, budget_s: float) -> bool:
    """(loop) Run ``first`` and the CPU tasks it makes ready on this thread, while they
    qualify.

    Returns True when the graph task completed here; otherwise every task left has been
    handed to the executors (call in the graph task's context: ``enter_graph_task``).
    """
    engine = graph_task.engine
    policy = engine.policy
    max_elements = policy.inline_max_elements
    max_flops = policy.inline_max_flops
    if not qualifies(first.node, first.inputs, max_elements, max_flops) or not graph_task.analyse(
        policy.inline_max_nodes
    ):
        graph_task.expect_completion_elsewhere()
        engine.push(first, buffer_device(first.inputs))
        return False
    deadline = time.perf_counter() + budget_s
    # As on the executors: see policy.NUMPY_ERRORS.
    if _numpy_error_state is None:  # pragma: no cover (NumPy 1.26)
        with numpy.errstate(all=NUMPY_ERRORS):
            heap = _run_tasks(graph_task, first, deadline, max_elements, max_flops)
    else:
        token = _enter_numpy_errors()
        try:
            heap = _run_tasks(graph_task, first, deadline, max_elements, max_flops)
        finally:
            _numpy_error_state.reset(token)
    if heap:
        graph_task.expect_completion_elsewhere()
        for _, _, left in heap:
            engine.push(left, CPU)
        return False
    return graph_task.completed


def _run_tasks(
    graph_task: GraphTask, first: NodeTask, deadline: float, max_elements: int, max_flops: float
) -> list[tuple[int, int, NodeTask]]:
    """``run_inline``'s loop: run ``first`` and the CPU tasks it makes ready while they
    qualify; return the heap of those left (empty when none is).

    A plain node (``Node._plain``) of a plain graph task is evaluated here rather than by
    ``evaluate_function`` and ``_make_ready``: the same steps in the same order (apply,
    release, ``validated``, the dependency bookkeeping under the graph task's lock), with
    the pass's constants read once and no list of successors for a node that makes one
    ready. Anything else (an async node, a hook, a stream) takes ``evaluate_function``.
    """
    engine = graph_task.engine
    heap: list[tuple[int, int, NodeTask]] = []
    pushed = 0
    fast = graph_task.plain  # (set by analyse, which ran before the first node)
    if _current_graph_task_get() is not graph_task:
        enter_graph_task(graph_task)
    task: NodeTask | None = first
    if fast:
        left_over = _run_schedule(graph_task, first, deadline, max_elements, max_flops)
        if left_over is None:
            return heap  # the pass is complete
        for successor in left_over:
            pushed = _push(graph_task, engine, heap, pushed, successor)
        del left_over
        if not heap:
            return heap  # (what is left runs on other devices)
        task = heapq.heappop(heap)[2]
        if time.perf_counter() > deadline or not qualifies(
            task.node, task.inputs, max_elements, max_flops
        ):
            pushed += 1
            heapq.heappush(heap, (-task.key, pushed, task))
            return heap
    # (read here: a pass the schedule completes needs none of them)
    keep_graph = graph_task.keep_graph
    lock = graph_task.lock
    dependencies = graph_task.dependencies
    not_ready = graph_task.not_ready
    depth_key = graph_task.depth_key
    while task is not None:
        node = task.node
        made: NodeTask | None = None
        more: list[NodeTask] | None = None
        # (Every task here has ``outputs`` None: an async node's continuation goes to the
        # executors. The context is the graph task's: entered before the loop, and nodes
        # that qualify are library code, which leaves it as it is.)
        if fast and node._plain and not graph_task.has_error:
            inputs = task.inputs
            try:
                task.inputs = _NO_INPUTS  # the buffer is ours: AccumulateGrad may steal it
                node_lock = node._lock
                node_lock.acquire()
                try:
                    outputs = node.apply(inputs)
                finally:
                    node_lock.release()
                if not keep_graph:
                    node.release_variables()
                edges = node._next_edges
                if edges and len(outputs) != len(edges):
                    validated(edges, outputs, node)  # (raises: the count is wrong)
                reuse: NodeTask | None = task
                lock.acquire()
                try:
                    i = -1  # (a counter, as in _make_ready)
                    for next_node, input_nr in edges:
                        i += 1
                        if next_node is None:
                            continue
                        grad = outputs[i]
                        if grad is not None:  # ``validated``'s check, in this loop
                            grad = conformed(i, grad, next_node, input_nr, node)
                        count = dependencies[next_node]
                        if count != 1:
                            dependencies[next_node] = count - 1
                            hold(graph_task, next_node, input_nr, node, i, grad)
                            continue
                        del dependencies[next_node]
                        buffer = not_ready.pop(next_node, None) if not_ready else None
                        if buffer is None and next_node._stream is None:
                            if type(next_node) is AccumulateGrad:
                                buffer = [grad]
                            else:
                                inputs_of_next = len(next_node._input_metadata)
                                if inputs_of_next == 1:
                                    buffer = [grad]
                                else:
                                    buffer = [None] * inputs_of_next
                                    buffer[input_nr] = grad
                        else:
                            buffer = complete_buffer(
                                graph_task, buffer, next_node, input_nr, node, i, grad
                            )
                        if reuse is not None:  # the first successor takes the finished task
                            reuse.node = next_node
                            reuse.inputs = buffer
                            reuse.key = depth_key | next_node.sequence_nr
                            successor, reuse = reuse, None
                        else:
                            successor = NodeTask(graph_task, next_node, buffer)
                        if made is None:
                            made = successor
                        elif more is None:
                            more = [made, successor]
                        else:
                            more.append(successor)
                    if made is None:  # this task ends, none starts
                        left = graph_task.outstanding_tasks = graph_task.outstanding_tasks - 1
                    elif more is not None:
                        left = graph_task.outstanding_tasks = (
                            graph_task.outstanding_tasks + len(more) - 1
                        )
                    else:
                        left = 1
                finally:
                    lock.release()
                # No local may keep a gradient past here: its reference count decides
                # whether the successor (AccumulateGrad, ReLU's backward) may steal it.
                del outputs
                grad = None
                if left == 0:
                    graph_task.all_tasks_done()
                    made = more = None
            except BaseException as exc:
                graph_task.set_error(exc, node, CPU, inputs)
                graph_task.task_finished()
                made = more = None
            del inputs  # (the buffer: a gradient passed on as it is may be in it)
            task = None
            if more is not None:
                for successor in more:
                    # (_push, inlined: no local may hold a gradient)
                    grads = successor.inputs
                    device = grads[0].device if grads[0] is not None else buffer_device(grads)
                    if device.type == "cpu":
                        pushed += 1
                        heapq.heappush(heap, (-successor.key, pushed, successor))
                    else:
                        graph_task.expect_completion_elsewhere()
                        engine.push(successor, device)
            elif made is not None:
                grads = made.inputs
                device = grads[0].device if grads[0] is not None else buffer_device(grads)
                if device.type != "cpu":
                    graph_task.expect_completion_elsewhere()
                    engine.push(made, device)
                elif not heap:
                    task = made  # a chain: the one successor runs next, without the heap
                else:
                    pushed += 1
                    heapq.heappush(heap, (-made.key, pushed, made))
        else:
            if not node._plain and node.is_async:
                graph_task.expect_completion_elsewhere()  # its continuation finishes the pass
            # ``reuse``: nothing here holds ``task`` once evaluated (the heap entry is gone).
            ready = evaluate_function(task, CPU, True)
            task = None
            if type(ready) is NodeTask:
                if not heap and buffer_device(ready.inputs).type == "cpu":
                    task = ready  # a chain: the one successor runs next, without the heap
                else:
                    pushed = _push(graph_task, engine, heap, pushed, ready)
            elif ready is not None:
                for successor in ready:  # type: ignore[union-attr]  # (the list)
                    pushed = _push(graph_task, engine, heap, pushed, successor)
        if task is None:
            if not heap:
                break
            task = heapq.heappop(heap)[2]
        if time.perf_counter() > deadline or not qualifies(
            task.node, task.inputs, max_elements, max_flops
        ):
            pushed += 1
            heapq.heappush(heap, (-task.key, pushed, task))
            break
    return heap


def _run_schedule(
    graph_task: GraphTask,
    first: NodeTask,
    deadline: float,
    max_elements: int,
    max_flops: float,
    on_deadline: Callable[[], float | None] | None = None,
) -> list[NodeTask] | None:
    """(loop, or the executor thread that took a pass's first task) Run a plain graph
    task's nodes in the order the ready queue would, without one: later-created nodes
    first, each leaf's ``AccumulateGrad`` as soon as its gradient is complete; return None
    once the pass is complete, else the tasks ready to run (the node where it stopped
    first), for ``_run_tasks``'s loop (or the executor's queue), which goes on from there.

    Why this is the queue's order: the queue runs the ready node with the highest
    ``sequence_nr`` (leaves have the highest), and a node's gradients come from nodes
    created after it, so the unrun node with the highest ``sequence_nr`` is ready whenever
    its turn comes. That is checked rather than assumed: a node not ready at its turn (a
    ``sequence_nr`` out of creation order) stops the schedule. It also stops at a node
    that is not plain, one that does not qualify, an error (the pass's: a cancellation
    too), or the deadline, unless ``on_deadline`` (an executor's: it pauses for the loop
    and the CPU budget, and says stop once other passes' tasks wait) gives a new one.
    Every step of a node is that of ``_run_tasks``'s loop (validation, dependency counts,
    buffers, fixed summation orders), so the state it leaves is the one the queue would
    have; only the ready tasks themselves (a ``NodeTask`` each, a heap, the count of
    outstanding tasks) are not made per node, and the graph task's lock is not taken:
    nothing has been handed off (no other thread, no async node has a task of this pass),
    so no other thread reads or writes its tables until the schedule returns (``cancel``
    only sets ``has_error``, read before every node).
    """
    dependencies = graph_task.dependencies
    not_ready = graph_task.not_ready
    keep_graph = graph_task.keep_graph
    # The nodes other than leaves, latest-created first (the walk found them all).
    order = [node for node in dependencies if type(node) is not AccumulateGrad]
    order.sort(key=_sequence_nr, reverse=True)
    end = len(order)
    position = 0
    ready: dict[Node, list[Tensor | None]] = {}  # nodes ready whose turn is to come
    leaves: list[tuple[Node, list[Tensor | None]]] = []  # leaves ready, in queue order
    node = first.node
    inputs = first.inputs
    first.inputs = _NO_INPUTS  # the buffer is ours: AccumulateGrad may steal it
    current = True  # ``node`` is ready with ``inputs`` (else stopped between nodes)
    while True:
        if not node._plain or graph_task.has_error:
            break  # (a hook, a stream: _run_tasks's loop takes it, through evaluate_function)
        try:
            node_lock = node._lock
            node_lock.acquire()
            try:
                outputs = node.apply(inputs)
            finally:
                node_lock.release()
            if not keep_graph and type(node) is not AccumulateGrad:  # (a leaf's saves nothing)
                node.release_variables()
            edges = node._next_edges
            if edges:
                if len(outputs) != len(edges):
                    validated(edges, outputs, node)  # (raises: the count is wrong)
                # (No lock: nothing else runs this graph task's nodes while the schedule does.)
                i = -1
                for next_node, input_nr in edges:
                    i += 1
                    if next_node is None:
                        continue
                    grad = outputs[i]
                    leaf = type(next_node) is AccumulateGrad
                    if grad is not None:
                        # (validate.conformed, written out as on the executors: a call
                        # fewer per edge)
                        if leaf:
                            variable = next_node._ref()  # type: ignore[attr-defined]
                            expected = variable.data
                            shape, dtype, device = expected.shape, expected.dtype, variable.device
                        else:
                            shape, dtype, device = next_node._input_metadata[input_nr]
                        if type(grad) is not Tensor or not (
                            grad.device is device
                            and (data := grad.data).shape == shape
                            and (data.dtype is dtype or data.dtype == dtype)
                        ):
                            grad = _conform(i, grad, shape, dtype, device, node)
                        data = None  # (no local may hold a gradient's array: see below)
                    count = dependencies[next_node]
                    if count != 1:
                        dependencies[next_node] = count - 1
                        hold(graph_task, next_node, input_nr, node, i, grad)
                        continue
                    del dependencies[next_node]
                    buffer = not_ready.pop(next_node, None) if not_ready else None
                    if buffer is None and next_node._stream is None:
                        if leaf:
                            leaves.append((next_node, [grad]))
                            continue
                        inputs_of_next = len(next_node._input_metadata)
                        if inputs_of_next == 1:
                            buffer = [grad]
                        else:
                            buffer = [None] * inputs_of_next
                            buffer[input_nr] = grad
                    else:
                        buffer = complete_buffer(
                            graph_task, buffer, next_node, input_nr, node, i, grad
                        )
                        if leaf:
                            leaves.append((next_node, buffer))
                            continue
                    ready[next_node] = buffer
            # No local may keep a gradient past here: its reference count decides whether
            # the successor (AccumulateGrad, ReLU's backward) may steal it.
            del outputs
            grad = None
        except BaseException as exc:
            graph_task.set_error(exc, node, CPU, inputs)
            del inputs
            tasks = _ready_tasks(graph_task, None, None, leaves, ready)
            graph_task.outstanding_tasks = len(tasks) + 1
            graph_task.task_finished()  # (the failed node's)
            return tasks
        if leaves:
            node, inputs = leaves.pop(0)
            if node._plain == INLINE:
                # A plain leaf's node qualifies: it is on the CPU (no stream), and the
                # price of the node that made it ready counted the leaf's elements.
                if time.perf_counter() > deadline:
                    later = on_deadline() if on_deadline is not None else None
                    if later is None:
                        break
                    deadline = later
                continue
        elif position < end:
            node = order[position]
            position += 1
            try:  # (no second local may hold the buffer: see owned_gradient)
                inputs = ready.pop(node)
            except KeyError:  # not ready at its turn: the queue's order differs from here
                current = False
                break
        else:  # every node has run
            graph_task.outstanding_tasks = 0
            graph_task.all_tasks_done()
            return None
        if time.perf_counter() > deadline:
            later = on_deadline() if on_deadline is not None else None
            if later is None:
                break
            deadline = later
        plain = node._plain
        if plain == INLINE:  # (not a leaf's node: a plain leaf went on above)
            elements = node._elements  # (counted at the node's creation, or negative)
            if elements > max_elements or (
                elements < 0 and not _elementwise_fits(node, inputs, max_elements)
            ):
                break
        elif not (
            _priced_qualifies(node, inputs, max_elements, max_flops)
            if plain == PRICED
            else qualifies(node, inputs, max_elements, max_flops)
        ):
            break
    tasks = _ready_tasks(graph_task, node if current else None, inputs, leaves, ready)
    graph_task.outstanding_tasks = len(tasks)
    return tasks


def schedule_on_executor(graph_task: GraphTask, first: NodeTask) -> list[NodeTask] | None:
    """(executor: the thread that took a plain CPU pass's first task, its only task) Run the
    pass in ``_run_schedule``'s order while its nodes are plain and small (as inline: larger
    ones are left to the queue, where several workers may share them), pausing for the loop
    and the CPU budget as the executor's loop does; return the tasks left ready, in the
    queue's order, or None once the pass is complete.

    A long chain's or a wide fan's backward (too large to start inline) then pays no ready
    queue, ``NodeTask`` or graph task lock per node: ~12% fewer instructions per chain node
    and ~20% per fan node (``benchmarks/callgrind.py``). It runs while this pass has the
    executor to itself: once another pass's task waits in the queue, it hands its ready
    tasks to the queue, whose priority order interleaves the passes node by node as before.
    """
    policy = graph_task.engine.policy
    return _run_schedule(
        graph_task,
        first,
        schedule_deadline(),
        policy.inline_max_elements,
        policy.inline_max_flops,
        schedule_pause,
    )


def _ready_tasks(
    graph_task: GraphTask,
    node: Node | None,
    inputs: list[Tensor | None] | None,
    leaves: list[tuple[Node, list[Tensor | None]]],
    ready: dict[Node, list[Tensor | None]],
) -> list[NodeTask]:
    """The tasks ``_run_schedule`` leaves ready, in the order the queue would run them."""
    tasks = [] if node is None else [NodeTask(graph_task, node, inputs)]  # type: ignore[arg-type]
    for leaf, buffer in leaves:
        tasks.append(NodeTask(graph_task, leaf, buffer))
    for next_node, buffer in ready.items():
        tasks.append(NodeTask(graph_task, next_node, buffer))
    return tasks


_sequence_nr = attrgetter("sequence_nr")


def _push(
    graph_task: GraphTask,
    engine: Engine,
    heap: list[tuple[int, int, NodeTask]],
    pushed: int,
    successor: NodeTask,
) -> int:
    """Put a successor on the pass's heap (CPU), or hand it to its device's executor."""
    # buffer_device's common case inline; no local may hold the gradient (its reference
    # count decides whether AccumulateGrad steals it)
    inputs = successor.inputs
    device = inputs[0].device if inputs and inputs[0] is not None else buffer_device(inputs)
    if device.type == "cpu":
        pushed += 1
        heapq.heappush(heap, (-successor.key, pushed, successor))
    else:
        graph_task.expect_completion_elsewhere()
        engine.push(successor, device)
    return pushed
