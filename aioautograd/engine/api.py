"""`backward` and `grad` (coroutines) and their blocking `*_sync` twins."""

from __future__ import annotations

import warnings
from collections.abc import Coroutine, Sequence
from typing import Any

from aioautograd.autograd.node import Edge, GradientEdge
from aioautograd.autograd.unawaited import forget_running, track
from aioautograd.engine.engine import Engine
from aioautograd.tensor import Tensor

TensorOrTensors = Tensor | Sequence[Tensor]
# What ``grad`` differentiates with respect to: tensors or gradient edges.
GradInputs = Tensor | GradientEdge | Sequence[Tensor | GradientEdge]


def _as_tuple(value: Any) -> tuple[Any, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)) and not isinstance(value, GradientEdge):
        return tuple(value)
    return (value,)


def _one_like(out: Tensor) -> Tensor:
    """The implicit gradient of the one-element ``out``: a one of its shape, dtype, device."""
    data, device = out.data, out.device
    # array(1).reshape: two C calls (ones_like is Python code, 5x the cost here).
    return Tensor(device.xp.array(1, dtype=data.dtype).reshape(data.shape), device)


def _make_grads(
    outputs: tuple[Tensor, ...], grads: tuple[Tensor | None, ...]
) -> list[Tensor | None]:
    if len(grads) != len(outputs):
        raise RuntimeError(
            f"got {len(grads)} gradients for {len(outputs)} outputs: pass one gradient (or "
            "None) per output"
        )
    result: list[Tensor | None] = []
    for i, (out, grad) in enumerate(zip(outputs, grads, strict=True)):
        if grad is None:
            if out.data.size != 1:
                raise RuntimeError(
                    "grad can be implicitly created only for scalar outputs "
                    f"(output {i} has shape {tuple(out.shape)}); pass `gradient=` with a "
                    "tensor of the output's shape"
                )
            if out.data.dtype.kind not in "fc":
                raise RuntimeError(
                    "grad can be implicitly created only for real scalar outputs but got "
                    f"{out.data.dtype}"
                )
            result.append(_one_like(out))
            continue
        if not isinstance(grad, Tensor):
            raise TypeError(
                f"gradients must be Tensors or None, but gradient {i} is a {type(grad).__name__}"
            )
        if grad.shape != out.shape:
            shape = tuple(out.shape)
            raise RuntimeError(
                f"Mismatch in shape: grad_output[{i}] has a shape of {tuple(grad.shape)} and "
                f"output[{i}] has a shape of {shape}. Pass a gradient of the output's shape "
                f"(the gradient of some scalar with respect to it; aioautograd.ones{shape} "
                "differentiates the sum of its elements), or call backward on a scalar such "
                "as output.sum()."
            )
        if grad.data.dtype.kind != out.data.dtype.kind:
            raise RuntimeError(
                f"Mismatch in dtype: grad_output[{i}] has dtype {grad.data.dtype} and "
                f"output[{i}] has dtype {out.data.dtype}; pass a gradient of the output's dtype."
            )
        if grad.device is not out.device:
            raise RuntimeError(
                f"Mismatch in device: grad_output[{i}] is on {grad.device} and output[{i}] is "
                f"on {out.device}; move the gradient with .to('{out.device}')."
            )
        result.append(grad)
    return result


def _root_edges(tensors: tuple[Tensor, ...]) -> list[Edge]:
    edges: list[Edge] = []
    for i, tensor in enumerate(tensors):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"backward expects Tensors, but element {i} is {type(tensor).__name__}")
        if not tensor._requires_grad:
            raise RuntimeError(
                f"element {i} of tensors does not require grad and does not have a grad_fn "
                "(was it computed under no_grad, or from tensors without requires_grad=True?)"
            )
        edges.append(tensor._gradient_edge())
    return edges


def _input_edges(inputs: tuple[Any, ...], allow_gradient_edges: bool = False) -> list[Edge]:
    edges: list[Edge] = []
    for tensor in inputs:
        if allow_gradient_edges and isinstance(tensor, GradientEdge):
            edges.append((tensor.node, tensor.output_nr))
            continue
        if not isinstance(tensor, Tensor):
            raise TypeError(f"inputs must be Tensors, got {type(tensor).__name__}")
        if not tensor._requires_grad:
            raise RuntimeError("One of the differentiated Tensors does not require grad")
        edges.append(tensor._gradient_edge())
    return edges


def _prepare_backward(
    tensors: TensorOrTensors,
    grad_tensors: Any,
    retain_graph: bool | None,
    create_graph: bool,
    inputs: TensorOrTensors | None,
) -> tuple[list[Edge], list[Tensor | None], bool, list[Edge] | None]:
    if type(tensors) is Tensor and grad_tensors is None and inputs is None and not create_graph:
        # ``loss.backward()``: the same checks, without the general case's tuples
        keep = False if retain_graph is None else retain_graph
        data = tensors.data
        if tensors._requires_grad and data.size == 1 and data.dtype.kind in "fc":
            # (a scalar that requires grad: its edge and a gradient of one, as
            # _root_edges and _make_grads make them, without their loops)
            return [tensors._gradient_edge()], [_one_like(tensors)], keep, None
        single = (tensors,)
        return _root_edges(single), _make_grads(single, (None,)), keep, None
    outputs = _as_tuple(tensors)
    input_tuple = _as_tuple(inputs)
    if inputs is not None and not input_tuple:
        raise RuntimeError("'inputs' argument to backward() cannot be empty.")
    grads = _as_tuple(grad_tensors) if grad_tensors is not None else (None,) * len(outputs)
    roots = _root_edges(outputs)
    checked = _make_grads(outputs, grads)
    keep_graph = create_graph if retain_graph is None else retain_graph
    input_edges = None
    if inputs is not None:
        input_edges = _input_edges(input_tuple)
        for tensor in input_tuple:
            if tensor.grad_fn is not None:
                # A non-leaf input gets its .grad as PyTorch does it: it retains grad.
                tensor.retain_grad()
    if create_graph:
        warnings.warn(
            "Using backward() with create_graph=True will create a reference cycle between "
            "the parameter and its gradient which can cause a memory leak. We recommend "
            "using autograd.grad when creating the graph to avoid this. If you have to use "
            "this function, make sure to reset the .grad fields of your parameters to None "
            "after use to break the cycle and avoid the leak.",
            UserWarning,
            stacklevel=3,
        )
    return roots, checked, keep_graph, input_edges


def backward(
    tensors: TensorOrTensors,
    grad_tensors: TensorOrTensors | None = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    inputs: TensorOrTensors | None = None,
) -> Coroutine[Any, Any, None]:
    """Accumulate gradients of ``tensors`` into the ``.grad`` of graph leaves.

    Returns a coroutine to ``await``: the pass runs on the engine's executors while the event
    loop keeps serving other tasks. Any number of backward passes may run concurrently
    (``asyncio.gather``). Reading ``.grad`` (``optimizer.step()`` does) after calling it
    without ``await`` raises an error instead of silently seeing no gradient.

    Args:
        tensors: roots to differentiate.
        grad_tensors: gradients w.r.t. each root (may be omitted for scalar roots).
        retain_graph: keep saved tensors for another backward (defaults to ``create_graph``).
        create_graph: record the backward pass itself, for higher-order gradients (warns,
            as PyTorch: ``.grad`` then references the graph that produced it; prefer
            :func:`grad`).
        inputs: accumulate only into these tensors. Their nodes run (with their hooks);
            a non-leaf input retains grad (``retain_grad()``) and gets ``.grad``.

    Raises:
        RuntimeError: for roots that do not require grad, non-scalar roots without a
            gradient, mismatched gradients, a second backward through freed saved tensors,
            or any error raised by a node (with a note naming the node).

    Example::

        loss = ((model(x) - y) ** 2).mean()
        await loss.backward()
    """
    return track(
        _backward(tensors, grad_tensors, retain_graph, create_graph, inputs),
        "aioautograd.backward(...)",
    )


async def _backward(
    tensors: TensorOrTensors,
    grad_tensors: TensorOrTensors | None,
    retain_graph: bool | None,
    create_graph: bool,
    inputs: TensorOrTensors | None,
) -> None:
    forget_running()
    roots, grads, keep_graph, outputs = _prepare_backward(
        tensors, grad_tensors, retain_graph, create_graph, inputs
    )
    await Engine.get_default_engine().execute(roots, grads, keep_graph, create_graph, True, outputs)


def backward_sync(
    tensors: TensorOrTensors,
    grad_tensors: TensorOrTensors | None = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    inputs: TensorOrTensors | None = None,
) -> None:
    """Blocking :func:`backward` for code without a running event loop (scripts, and
    backward functions of sync nodes, where it runs reentrantly on the executor thread).

    Raises:
        RuntimeError: when called on a thread that runs an event loop (use ``await``).
    """
    roots, grads, keep_graph, outputs = _prepare_backward(
        tensors, grad_tensors, retain_graph, create_graph, inputs
    )
    Engine.get_default_engine().execute_sync(roots, grads, keep_graph, create_graph, True, outputs)


def _prepare_grad(
    outputs: TensorOrTensors,
    inputs: GradInputs,
    grad_outputs: Any,
    retain_graph: bool | None,
    create_graph: bool,
) -> tuple[list[Edge], list[Tensor | None], bool, list[Edge]]:
    output_tuple = _as_tuple(outputs)
    input_tuple = _as_tuple(inputs)
    if not input_tuple:
        raise RuntimeError(
            "`inputs` argument to `grad()` cannot be empty: pass the tensors to "
            "differentiate with respect to"
        )
    grads = _as_tuple(grad_outputs) if grad_outputs is not None else (None,) * len(output_tuple)
    roots = _root_edges(output_tuple)
    checked = _make_grads(output_tuple, grads)
    keep_graph = create_graph if retain_graph is None else retain_graph
    return roots, checked, keep_graph, _input_edges(input_tuple, allow_gradient_edges=True)


def _finish_grad(
    captured: list[Tensor | None],
    inputs: GradInputs,
    allow_unused: bool,
    materialize_grads: bool,
    create_graph: bool,
) -> tuple[Tensor | None, ...]:
    input_tuple = _as_tuple(inputs)
    result: list[Tensor | None] = []
    for tensor, grad in zip(input_tuple, captured, strict=True):
        if grad is None:
            if materialize_grads and isinstance(tensor, GradientEdge):
                shape, dtype, device = tensor.node.input_metadata(tensor.output_nr)
                # Zeros that require grad under create_graph (a leaf), as PyTorch makes them.
                grad = Tensor(device.xp.zeros(shape, dtype), device, create_graph)
            elif materialize_grads:
                grad = Tensor(tensor.xp.zeros_like(tensor.data), tensor.device, create_graph)
            elif not allow_unused:
                raise RuntimeError(
                    "One of the differentiated Tensors appears to not have been used in the "
                    "graph. Set allow_unused=True if this is the desired behavior."
                )
        result.append(grad)
    return tuple(result)


async def grad(
    outputs: TensorOrTensors,
    inputs: GradInputs,
    grad_outputs: TensorOrTensors | None = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    allow_unused: bool | None = None,
    materialize_grads: bool = False,
) -> tuple[Tensor | None, ...]:
    """Return the gradients of ``outputs`` with respect to ``inputs`` (``.grad`` untouched).

    Only the part of the graph between them runs. With ``create_graph=True`` the results
    are differentiable (Hessian-vector products, gradient penalties). An input may be a
    ``graph.GradientEdge`` instead of a tensor.

    Raises:
        RuntimeError: if an input was not used in the graph and ``allow_unused`` is false,
            plus everything :func:`backward` raises.
    """
    roots, grads, keep_graph, edges = _prepare_grad(
        outputs, inputs, grad_outputs, retain_graph, create_graph
    )
    captured = await Engine.get_default_engine().execute(
        roots, grads, keep_graph, create_graph, False, edges
    )
    return _finish_grad(captured, inputs, bool(allow_unused), materialize_grads, create_graph)


def grad_sync(
    outputs: TensorOrTensors,
    inputs: GradInputs,
    grad_outputs: TensorOrTensors | None = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    allow_unused: bool | None = None,
    materialize_grads: bool = False,
) -> tuple[Tensor | None, ...]:
    """Blocking :func:`grad` (see :func:`backward_sync` for where it may be called)."""
    roots, grads, keep_graph, edges = _prepare_grad(
        outputs, inputs, grad_outputs, retain_graph, create_graph
    )
    captured = Engine.get_default_engine().execute_sync(
        roots, grads, keep_graph, create_graph, False, edges
    )
    return _finish_grad(captured, inputs, bool(allow_unused), materialize_grads, create_graph)
