"""`evaluate_function`: what a worker does with one `NodeTask` (mirrors engine.cpp).

Order, as in PyTorch: tensor pre-hooks (and ``retain_grad``), captures for ``grad()``,
node pre-hooks, the node, ``validate_outputs``, post-hooks, the anomaly NaN check, release of
saved tensors, then the dependency bookkeeping that fills input buffers and makes successor
tasks ready (PyTorch's ``call_function`` and the rest of ``evaluate_function``).

Where it runs (see ``graph_task.py`` for the picture): on an executor thread (through
``evaluate_task``), or on the awaiting event loop's thread for the small CPU nodes that
inline execution takes (``inline.py``). An ``async`` node's ``apply`` is the one part that
runs as a task on the loop; its outputs come back here through ``push_continuation``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from aioautograd.anomaly_mode import current_node
from aioautograd.autograd.node import AccumulateGrad, Node
from aioautograd.autograd.saved import describe
from aioautograd.devices.device import Device
from aioautograd.engine.graph_task import GraphTask, current_graph_task, enter_graph_task
from aioautograd.engine.input_buffer import accumulate, slot_orders
from aioautograd.engine.ready_queue import TIE_BITS, NodeTask
from aioautograd.engine.validate import _conform, validate_outputs, validated
from aioautograd.grad_mode import _grad_enabled_get
from aioautograd.tensor import Tensor

if TYPE_CHECKING:
    from aioautograd.devices.streams import Stream
    from aioautograd.engine.engine import Engine
    from aioautograd.engine.executor import Executor

Grads = list[Tensor | None]
# The successors a node made ready: one task as it is (a chain's case, the most common: no
# list is built for it), several in a list, or None.
Ready = NodeTask | list[NodeTask] | None
_NO_INPUTS: Grads = []
# Bound once (see grad_mode._grad_enabled_get): read for every node.
_current_graph_task_get = current_graph_task.get
_new_task = NodeTask.__new__


def evaluate_task(
    engine: Engine, task: NodeTask, executor: Executor, drain: bool
) -> NodeTask | None:
    """(executor) Evaluate ``task``; return the task to run next on this thread, if any: a
    successor, or with ``drain`` (the caller would pop the queue next) possibly the queue's
    first task, popped in the same lock round trip as the successors' pushes."""
    device = executor.device
    made = evaluate_function(task, device, True)
    if made is None:
        return None
    if type(made) is NodeTask:
        # The chain's case, without Engine.dispatch: one successor whose first gradient is
        # on this device runs next here, unless a task of higher priority waits (as dispatch).
        grads = made.inputs
        first = grads[0]
        if first is not None and first.device is device:
            # ReadyQueue.top_key, inlined: an unlocked peek (``ordered`` is empty only while
            # the heap is)
            ordered = executor.ordered
            if not ordered:
                return made
            key = made.key
            heap = executor.heap
            try:
                if ordered[0].key > key or (heap and -(heap[0] >> TIE_BITS) > key):
                    ready = [made]
                else:
                    return made
            except IndexError:  # emptied by another thread since the test
                return made
        else:
            ready = [made]
    else:
        ready = made  # type: ignore[assignment]  # (not a NodeTask: the list)
        if len(ready) == 2:  # a fan's add: ReadyQueue.push_pair has its case written out
            a, b = ready
            grads, others = a.inputs, b.inputs
            if (
                grads
                and others
                and (first := grads[0]) is not None
                and (other := others[0]) is not None
                and first.device is device
                and other.device is device
            ):
                return executor.queue.push_pair(a, b, drain)
    # Engine.dispatch for the fan's case, every successor on this device (the caller's
    # executor serves it): the highest-priority one runs next here unless a task of higher
    # priority waits; the others go to the queue under one lock, in dispatch's order (then,
    # with ``drain``, the queue's first task comes back in the same round trip).
    local: NodeTask | None = None
    for successor in ready:
        grads = successor.inputs
        first = grads[0] if grads else None
        if first is None or first.device is not device:
            return engine.dispatch(ready, device)  # a gradient elsewhere, or none first
        if local is None or successor.key > local.key:
            local = successor
    assert local is not None
    return executor.queue.push_local(ready, local, drain)


def evaluate_function(task: NodeTask, device: Device, reuse: bool = False) -> Ready:
    """(executor or loop) Evaluate ``task`` on this thread and return the successor tasks it
    made ready (``Ready``: one task, a list of several, or ``None``). With ``reuse`` (the
    caller holds ``task`` for nothing else), the first successor may be ``task`` itself,
    refilled.

    Errors fail the graph task (delivered to whoever awaits it) and are not raised here:
    the thread lives on (re-raising would kill a worker and shrink the executor for every
    other graph task).
    """
    graph_task = task.graph_task
    if graph_task.has_error:
        graph_task.task_finished()
        return None
    node = task.node
    inputs = task.inputs
    try:
        if _current_graph_task_get() is not graph_task:
            # Worker threads keep their own context; it changes only when they switch tasks.
            enter_graph_task(graph_task)
        if graph_task.pending_analysis is not None:  # first task: only one exists, no race
            graph_task.analyse()
            if graph_task.plain and node._plain and device.type == "cpu" and task.outputs is None:
                inputs = _NO_INPUTS  # (the schedule takes the buffer from the task: no
                # second reference, see Node.owned_gradient)
                return (_schedule_on_executor or _load_schedule_on_executor())(graph_task, task)
        if task.outputs is not None:  # an async node finished on the loop
            outputs = _finish_outputs(graph_task, node, task.outputs, inputs)
        elif node._plain and graph_task.plain:
            # The hot path: a CPU node without hooks (``Node._plain``) in a graph task without
            # grad() outputs, leaf hook, anomaly mode or profiler (what _call_function does,
            # minus the checks).
            task.inputs = _NO_INPUTS
            lock = node._lock
            lock.acquire()
            try:
                outputs = node.apply(inputs)
            finally:
                lock.release()
            if not graph_task.keep_graph:
                node.release_variables()
            edges = node._next_edges
            if not edges:  # a leaf's AccumulateGrad: this task ends, none starts
                graph_task.task_finished()
                return None
            if len(outputs) != len(edges):
                validated(edges, outputs, node)  # (raises: the count is wrong)
            # (a plain node has no stream: its gradients are produced on none; _make_ready
            # validates them, ``check``)
            return _make_ready(graph_task, node, outputs, task if reuse else None, None, True)
        else:
            task.inputs = _NO_INPUTS  # the buffer is ours now; AccumulateGrad may steal from it
            called = _call_function(graph_task, node, inputs, device)
            if called is None:  # handed to the event loop, or nothing to run
                return None
            outputs = called
        return _make_ready(
            graph_task,
            node,
            outputs,
            task if reuse and task.outputs is None else None,
            node._stream,
        )
    except BaseException as exc:
        graph_task.set_error(exc, node, device, inputs)
        graph_task.task_finished()
        return None


_schedule_on_executor: Callable[[GraphTask, NodeTask], list[NodeTask] | None] | None = None


def _load_schedule_on_executor() -> Callable[[GraphTask, NodeTask], list[NodeTask] | None]:
    # inline.py imports this module: bound on first use
    global _schedule_on_executor
    from aioautograd.engine.inline import schedule_on_executor

    _schedule_on_executor = schedule_on_executor
    return schedule_on_executor


def _call_function(
    graph_task: GraphTask, node: Node, inputs: Grads, device: Device
) -> Sequence[Tensor | None] | None:
    if node._tensor_pre_hooks or node._retains_grad_hooks:
        inputs = _call_tensor_pre_hooks(node, inputs)
    exec_info = graph_task.exec_info
    if exec_info is not None:
        info = exec_info.get(node)  # the root has no entry when no output is reachable
        if info is not None and info.captures:
            with graph_task.lock:
                for input_nr, output_idx in info.captures:
                    graph_task.captured_vars[output_idx] = inputs[input_nr]
        if info is None or not info.needed:
            graph_task.task_finished()
            return None
    if node._pre_hooks:
        for hook in tuple(node._pre_hooks.values()):
            result = hook(tuple(inputs))
            if result is not None:
                inputs = list(result)
    if graph_task.leaf_hook is not None and isinstance(node, AccumulateGrad):
        # The gradient goes to the hook (a distributed autograd context), not to ``.grad``.
        grad = inputs[0]
        if grad is not None:
            with node._lock:
                graph_task.leaf_hook(node.variable, grad)
        return _finish_outputs(graph_task, node, (), inputs)
    if node.is_async:
        if graph_task.loop is not None and graph_task.loop.is_running():
            graph_task.start_async_node(node, inputs)
            return None
        outputs: Sequence[Tensor | None] = asyncio.run(node.apply(inputs))  # type: ignore[arg-type]
        return _finish_outputs(graph_task, node, outputs, inputs)
    # Post-hooks get the gradients the node received: apply may consume the buffer
    # (AccumulateGrad steals from it, materialization fills it).
    received: Sequence[Tensor | None] = tuple(inputs) if node._post_hooks else inputs
    stream = node._stream
    if stream is None:
        if graph_task.anomaly.enabled or graph_task.profiler is not None:
            outputs = _apply_observed(graph_task, node, inputs, device)
        else:
            with node._lock:
                outputs = node.apply(inputs)
        return _finish_outputs(graph_task, node, outputs, received)
    # An accelerator node: its backward (and the validation of its outputs) runs on the
    # stream that was current at its forward.
    with stream.device.backend.use_stream(stream, node.name()):
        outputs = _apply_observed(graph_task, node, inputs, device)
        if isinstance(node, AccumulateGrad):
            graph_task.leaf_streams.add(stream)
        return _finish_outputs(graph_task, node, outputs, received)


def _apply_observed(
    graph_task: GraphTask, node: Node, inputs: Grads, device: Device
) -> Sequence[Tensor | None]:
    """``node.apply`` with anomaly mode (parent tracking) and the profiler, when enabled."""
    token = current_node.set(node) if graph_task.anomaly.enabled else None
    start = time.perf_counter_ns() if graph_task.profiler is not None else 0
    try:
        with node._lock:
            return node.apply(inputs)
    finally:
        if token is not None:
            current_node.reset(token)
        if graph_task.profiler is not None:
            graph_task.profiler.record(node, graph_task.id, device, start, graph_task.label)


def _finish_outputs(
    graph_task: GraphTask,
    node: Node,
    outputs: Sequence[Tensor | None],
    inputs: Sequence[Tensor | None],
) -> Sequence[Tensor | None]:
    if not graph_task.keep_graph:
        node.release_variables()
    edges = node._next_edges
    if edges:
        outputs = validate_outputs(edges, outputs, node)
    if node._post_hooks:
        input_tuple = tuple(inputs)
        for hook in tuple(node._post_hooks.values()):
            result = hook(tuple(outputs), input_tuple)
            if result is not None:
                outputs = list(result)
    if graph_task.anomaly.enabled and graph_task.anomaly.check_nan:
        _check_nan(node, outputs)
    return outputs


def _call_tensor_pre_hooks(node: Node, inputs: Grads) -> Grads:
    # The buffer belongs to this task: update it in place (no copy, so AccumulateGrad can
    # still steal an unshared gradient).
    if node._tensor_pre_hooks:
        for input_nr, hooks in node._tensor_pre_hooks.items():
            for hook in tuple(hooks.values()):
                # As in PyTorch, a hook also sees None (an output that got no gradient,
                # e.g. the unused results of unbind) and may not replace it.
                grad = inputs[input_nr]
                result = hook(grad)
                if result is not None:
                    if grad is None:
                        raise RuntimeError(
                            "can't replace a None gradient with a non-None value: a tensor "
                            "hook called with None (its tensor received no gradient) must "
                            "return None"
                        )
                    if not isinstance(result, Tensor):
                        name = getattr(hook, "__qualname__", repr(hook))
                        raise TypeError(
                            f"expected Tensor or None (got {type(result).__name__}): hook "
                            f"'{name}' must return the new gradient as a Tensor, or None to "
                            "keep the gradient it was given"
                        )
                    inputs[input_nr] = result
    if node._retains_grad_hooks:
        for input_nr, tensor_ref in node._retains_grad_hooks.items():
            tensor = tensor_ref()
            grad = inputs[input_nr]
            if tensor is None or grad is None:
                continue
            if tensor._grad is None:
                tensor._grad = grad if grad.grad_fn is not None else grad.detach().clone()
            else:
                tensor._grad = tensor._grad + grad
    return inputs


def _check_nan(node: Node, outputs: Sequence[Tensor | None]) -> None:
    for i, grad in enumerate(outputs):
        if grad is not None and grad.data.dtype.kind in "fc" and grad.xp.isnan(grad.data).any():
            error = RuntimeError(
                f"Function '{node.name()}' returned nan values in its {i}th output."
            )
            next_node = node._next_edges[i][0]
            error.add_note(
                f"Output {i} of {node.name()} is the gradient for "
                f"{next_node.name() if next_node is not None else 'nothing'}: {describe(grad)}"
            )
            raise error


def _make_ready(
    graph_task: GraphTask,
    node: Node,
    outputs: Sequence[Tensor | None],
    reuse: NodeTask | None,
    producer: Stream | None,
    check: bool = False,
) -> Ready:
    """Dependency bookkeeping: fill input buffers and return the successors made ready: one
    task as it is (a chain's case: no list per node), several in a list, none as ``None``
    (``reuse``: a finished task to refill for the first successor made ready, saving an
    allocation per node of a chain; ``producer``: ``node``'s stream; ``check``: validate
    each gradient here, as ``validated`` does, for a caller that has checked only their
    count: one loop over the edges instead of two)."""
    exec_info = graph_task.exec_info
    made: NodeTask | None = None  # the first successor made ready
    more: list[NodeTask] | None = None  # all of them, once there are several
    lock = graph_task.lock
    lock.acquire()  # (cheaper than ``with``, and this runs once per node)
    try:
        dependencies = graph_task.dependencies
        not_ready = graph_task.not_ready
        i = -1  # a counter, not enumerate() or zip(): this runs for every node
        for next_node, input_nr in node._next_edges:
            i += 1
            if next_node is None:
                continue
            if exec_info is not None:
                info = exec_info.get(next_node)
                if info is None or not info.should_execute():
                    continue
            grad = outputs[i]
            if check and grad is not None:
                # (validate.conformed, written out: this is the executors' per-node path,
                # and the call costs a chain node 2% more instructions)
                if type(next_node) is AccumulateGrad:
                    variable = next_node._ref()  # (the property's read, without its call)
                    leaf = variable.data
                    shape, dtype, device = leaf.shape, leaf.dtype, variable.device
                else:
                    shape, dtype, device = next_node._input_metadata[input_nr]
                if type(grad) is not Tensor or not (
                    grad.device is device
                    and (data := grad.data).shape == shape
                    and (data.dtype is dtype or data.dtype == dtype)
                ):
                    grad = _conform(i, grad, shape, dtype, device, node)
            count = dependencies[next_node]
            if count == 1:
                del dependencies[next_node]
                buffer = not_ready.pop(next_node, None) if not_ready else None
                if buffer is None and producer is None and next_node._stream is None:
                    # The chain's case: a fresh CPU buffer, nothing to accumulate.
                    # (``[grad]`` for a node of one input: ``[None] * n`` builds two lists)
                    if type(next_node) is AccumulateGrad or len(next_node._input_metadata) == 1:
                        buffer = [grad]
                    else:
                        buffer = [None] * len(next_node._input_metadata)
                        buffer[input_nr] = grad
                else:
                    # complete_buffer, inlined: a fan-in's last gradient comes here
                    if buffer is None:
                        buffer = _new_buffer(next_node)
                        accumulate(buffer, input_nr, grad, producer, next_node._stream)
                    else:
                        _add(graph_task, buffer, next_node, input_nr, node, i, grad, producer)
                        graph_task.slot_orders.pop(next_node, None)
                if reuse is not None:  # the first successor made ready takes the finished task
                    reuse.node = next_node
                    reuse.inputs = buffer
                    reuse.key = graph_task.depth_key | next_node.sequence_nr
                    successor, reuse = reuse, None
                else:
                    # NodeTask(graph_task, next_node, buffer), written out: CPython 3.11 runs
                    # a Python __init__ in a frame of its own (a fan's add makes one task
                    # here: ~25% of its cost, timeit)
                    successor = _new_task(NodeTask)
                    successor.graph_task = graph_task
                    successor.node = next_node
                    successor.inputs = buffer
                    successor.outputs = None
                    successor.key = graph_task.depth_key | next_node.sequence_nr
                if made is None:
                    made = successor
                elif more is None:
                    more = [made, successor]
                else:
                    more.append(successor)
            else:
                dependencies[next_node] = count - 1
                hold(graph_task, next_node, input_nr, node, i, grad, producer)
        if made is None:  # this task ends, none starts
            left = graph_task.outstanding_tasks = graph_task.outstanding_tasks - 1
        elif more is not None:
            left = graph_task.outstanding_tasks = graph_task.outstanding_tasks + len(more) - 1
        else:  # one ends, one starts: the count stays (at least 1)
            left = 1
    finally:
        lock.release()
    if left == 0:
        graph_task.all_tasks_done()
        return None
    return more if more is not None else made


def _add(
    graph_task: GraphTask,
    buffer: list[Tensor | None],
    next_node: Node,
    input_nr: int,
    node: Node,
    output_nr: int,
    grad: Tensor | None,
    producer: Stream | None,
) -> None:
    """Add a gradient into a buffer that several edges feed: in the input's fixed order
    when three or more edges feed it (bitwise the same sum whatever the scheduling)."""
    orders = graph_task.slot_orders.get(next_node)
    order = orders[input_nr] if orders is not None else None
    if order is None:
        accumulate(buffer, input_nr, grad, producer, next_node._stream)
    else:
        order.add(buffer, input_nr, node, output_nr, grad, producer, next_node._stream)


def _new_buffer(node: Node) -> list[Tensor | None]:
    # A leaf's node has one input (its metadata is read live from the leaf: skip building it).
    return [None] if type(node) is AccumulateGrad else [None] * len(node._input_metadata)


def _new_held_buffer(graph_task: GraphTask, next_node: Node) -> list[Tensor | None]:
    """(under the graph task's lock) The buffer of ``next_node``, which several edges feed,
    made when its first gradient comes, with the fixed order of its inputs' sums."""
    buffer = graph_task.not_ready[next_node] = _new_buffer(next_node)
    producers = graph_task.fan_in.get(next_node)
    if producers is not None:
        orders = slot_orders(next_node, producers)
        if orders is not None:
            graph_task.slot_orders[next_node] = orders
    return buffer


def hold(
    graph_task: GraphTask,
    next_node: Node,
    input_nr: int,
    node: Node,
    output_nr: int,
    grad: Tensor | None,
    producer: Stream | None = None,
) -> None:
    """(under the graph task's lock, or in a schedule) Put ``grad``, which ``node`` sent
    along its edge ``output_nr``, in the buffer of ``next_node``, which other edges still
    feed: the bookkeeping of a gradient that does not make its consumer ready (every
    branch of a fan comes here)."""
    buffer = graph_task.not_ready.get(next_node)
    if buffer is None:
        buffer = _new_held_buffer(graph_task, next_node)
    orders = graph_task.slot_orders.get(next_node)
    order = orders[input_nr] if orders is not None else None
    if order is None:
        accumulate(buffer, input_nr, grad, producer, next_node._stream)
    elif (
        order.owned
        and not order.held
        and order.outputs is None
        and grad is not None
        and producer is None
        and (k := order.next) < len(expected := order.expected)
        and expected[k] is node
        and next_node._stream is None
        and not _grad_enabled_get()
    ):
        # SlotOrder.add's in-place sum on CPU, written out (every branch of a fan but the
        # first two: ~370 instructions per fan node fewer than through SlotOrder.add)
        old = buffer[input_nr]
        data = old.data  # type: ignore[union-attr]  # (owned: a sum is there)
        old.device.xp.add(data, grad.data, data)  # type: ignore[union-attr]
        order.next = k + 1
    else:
        order.add(buffer, input_nr, node, output_nr, grad, producer, next_node._stream)


def complete_buffer(
    graph_task: GraphTask,
    buffer: list[Tensor | None] | None,
    next_node: Node,
    input_nr: int,
    node: Node,
    output_nr: int,
    grad: Tensor | None,
) -> list[Tensor | None]:
    """(under the graph task's lock, CPU) The buffer of ``next_node`` with ``grad``, its last
    gradient, added: ``_make_ready``'s case of a buffer held before (a node fed by several
    edges) or of a consumer with a stream, for the inline passes (``_make_ready`` has it
    inlined)."""
    if buffer is None:
        buffer = _new_buffer(next_node)
        accumulate(buffer, input_nr, grad, None, next_node._stream)
    else:
        _add(graph_task, buffer, next_node, input_nr, node, output_nr, grad, None)
        graph_task.slot_orders.pop(next_node, None)
    return buffer
