"""Custom differentiable functions: `Function`, `FunctionCtx` and `once_differentiable`.

As in PyTorch, each ``Function`` subclass gets a backward node class (``<Name>Backward``, or
``<Name>Backward0`` for the built-in ops) whose instances double as the ``ctx`` passed to
``forward`` and ``backward``. ``backward`` may be ``async def``: the engine then awaits it on
the event loop while the executors keep running other nodes.
"""

from __future__ import annotations

import functools
import inspect
import traceback
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from aioautograd.anomaly_mode import _anomaly, current_node
from aioautograd.autograd.node import Edge, Error, Grads, Node
from aioautograd.autograd.saved import (
    HookedSavedTensor,
    SavedTensor,
    saved_tensors_hooks_stack,
    second_backward_error,
    unpack_arrays,
)
from aioautograd.grad_mode import _grad_enabled
from aioautograd.tensor import Tensor


class FunctionCtx:
    """The ``ctx`` of a ``Function``: what ``forward`` leaves for ``backward``."""

    # Class-level defaults keep the no-grad path free of per-call set-up.
    to_save: tuple[Any, ...] = ()
    dirty_tensors: tuple[Tensor, ...] = ()
    non_differentiable: tuple[Tensor, ...] = ()
    materialize_grads: bool = True
    needs_input_grad: tuple[bool, ...] = ()

    def save_for_backward(self, *tensors: Tensor | None) -> None:
        """Save tensors for ``backward``; read them back with ``ctx.saved_tensors``.

        Saved tensors are checked against in-place modification when unpacked and freed after
        backward unless ``retain_graph=True``.
        """
        self.to_save = tensors

    def mark_dirty(self, *tensors: Tensor) -> None:
        """Declare inputs that ``forward`` modified in place (and returns as outputs)."""
        self.dirty_tensors = tensors

    def mark_non_differentiable(self, *tensors: Tensor) -> None:
        """Declare outputs that are not differentiable (they will not require grad)."""
        self.non_differentiable = tensors

    def set_materialize_grads(self, value: bool) -> None:
        """Whether ``None`` output gradients are passed to ``backward`` as zeros (default)."""
        self.materialize_grads = value


class BackwardCFunction(Node, FunctionCtx):
    """The node (and ``ctx``) of one application of a ``Function``."""

    _forward_cls: ClassVar[type[Function]]
    _saved: tuple[SavedTensor | None, ...] | None = ()
    _released: bool = False

    @property
    def saved_tensors(self) -> tuple[Tensor | None, ...]:
        saved = self._saved
        if saved is None:
            raise second_backward_error()
        return tuple(None if s is None else s.unpack(self) for s in saved)

    @property
    def saved_arrays(self) -> tuple[Any, ...]:
        """The arrays of the saved tensors (``None`` for ``None``), version-checked: for the
        backward formulas that compute on arrays when nothing is recorded."""
        saved = self._saved
        if saved is None:
            raise second_backward_error()
        return unpack_arrays(saved, self) if saved else ()

    def apply(self, grads: Grads) -> Sequence[Tensor | None]:
        if self.materialize_grads:
            for grad in grads:
                if grad is None:
                    _materialize(self, grads)
                    break
        backward = self._forward_cls.backward
        result = backward(self, grads[0]) if len(grads) == 1 else backward(self, *grads)
        if type(result) is tuple and len(result) == len(self._next_edges):
            return result
        return _check_gradient_count(self, result)

    def release_variables(self) -> None:
        self._saved = None

    def _save_variables(self, outputs: tuple[Any, ...]) -> None:
        hooks = saved_tensors_hooks_stack.get()
        saved: list[SavedTensor | None] = []
        for tensor in self.to_save:
            if tensor is None:
                saved.append(None)
            elif not isinstance(tensor, Tensor):
                raise TypeError(
                    "save_for_backward can only save tensors, but argument "
                    f"{len(saved)} is of type {type(tensor).__name__}"
                )
            else:
                is_output = tensor is outputs[0] or any(tensor is out for out in outputs[1:])
                if hooks:
                    saved.append(HookedSavedTensor(tensor, is_output, *hooks[-1]))
                else:
                    saved.append(SavedTensor(tensor, is_output))
        self._saved = tuple(saved)
        self.to_save = ()


class AsyncBackwardCFunction(BackwardCFunction):
    """Node of a ``Function`` whose ``backward`` is ``async def``: awaited on the event loop."""

    is_async = True

    async def apply(self, grads: Grads) -> Sequence[Tensor | None]:  # type: ignore[override]
        if self.materialize_grads:
            _materialize(self, grads)
        result = await self._forward_cls.backward(self, *grads)
        return _check_gradient_count(self, result)


def _materialize(node: BackwardCFunction, grads: Grads) -> None:
    """Replace ``None`` gradients by zeros of the shapes the node's inputs have."""
    for i, grad in enumerate(grads):
        if grad is None:
            shape, dtype, device = node._input_metadata[i]
            grads[i] = Tensor(device.xp.zeros(shape, dtype), device)


def _check_gradient_count(node: BackwardCFunction, result: Any) -> Sequence[Tensor | None]:
    if not isinstance(result, tuple):
        result = (result,)
    expected = len(node._next_edges)
    if len(result) != expected:
        if len(result) > expected and all(r is None for r in result[expected:]):
            return result[:expected]  # type: ignore[no-any-return]
        raise RuntimeError(
            f"function {node.name()} returned an incorrect number of gradients "
            f"(expected {expected}, got {len(result)})"
        )
    return result  # type: ignore[no-any-return]


class Function:
    """Base class for differentiable operations with a custom backward.

    Subclasses define static ``forward(ctx, *args)`` and ``backward(ctx, *grad_outputs)``
    (plain or ``async def``) and are called through ``apply``::

        class Square(Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return x * x            # tensor ops inside forward are not recorded

            @staticmethod
            def backward(ctx, grad):
                (x,) = ctx.saved_tensors
                return 2 * x * grad

        y = Square.apply(x)

    ``backward`` returns one gradient (or ``None``) per ``forward`` argument.
    """

    _backward_cls: ClassVar[type[BackwardCFunction]]
    # ``forward`` itself, or ``forward`` then ``setup_context`` (set per subclass).
    _forward_with_ctx: ClassVar[Callable[..., Any]]
    # Built-in ops name their nodes like PyTorch's generated ones: ``MulBackward0``.
    _node_suffix: ClassVar[str] = "Backward"
    # Whether the backward runs only library code (built-in ops), so that the engine may
    # run the node inline on the awaiting thread; user Functions run on the executors.
    _inline_backward: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        base = (
            AsyncBackwardCFunction
            if inspect.iscoroutinefunction(inspect.unwrap(cls.backward))
            else BackwardCFunction
        )
        cls._backward_cls = type(
            cls.__name__ + cls._node_suffix,
            (base,),
            {"_forward_cls": cls, "inline": cls._inline_backward and base is BackwardCFunction},
        )
        if cls.setup_context is Function.setup_context:
            cls._forward_with_ctx = cls.forward
        else:
            cls._forward_with_ctx = staticmethod(functools.partial(_forward_then_setup, cls))

    @staticmethod
    def forward(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("Function subclasses must implement forward(ctx, ...)")

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        raise NotImplementedError("Function subclasses must implement backward(ctx, ...)")

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        """Override to use PyTorch's split style: ``forward(*args)`` takes no ``ctx`` and
        ``setup_context(ctx, inputs, output)`` fills ``ctx`` (``save_for_backward``,
        ``mark_dirty``, attributes) from the inputs and forward's output::

            class Square(Function):
                @staticmethod
                def forward(x):
                    return x * x

                @staticmethod
                def setup_context(ctx, inputs, output):
                    (x,) = inputs
                    ctx.save_for_backward(x)

                @staticmethod
                def backward(ctx, grad):
                    (x,) = ctx.saved_tensors
                    return 2 * x * grad
        """
        raise NotImplementedError("setup_context is not overridden")

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        """Run ``forward`` and, when grad mode is on and an input requires grad, record a node."""
        if _grad_enabled.get():
            for arg in args:
                if isinstance(arg, Tensor) and arg._requires_grad:
                    return _apply_with_grad(cls, args, kwargs)
        ctx = FunctionCtx()
        outputs = cls._forward_with_ctx(ctx, *args, **kwargs)
        for tensor in ctx.dirty_tensors:
            if not args or tensor is not args[0]:
                _check_dirty_are_inputs(cls, (tensor,), args)
            tensor._bump_version()
        return outputs


_NO_EDGE: Edge = (None, 0)


def _forward_then_setup(cls: type[Function], ctx: Any, *args: Any, **kwargs: Any) -> Any:
    """``forward`` without ``ctx``, then ``setup_context``: what ``apply`` runs for a
    ``Function`` that overrides ``setup_context``."""
    if kwargs:
        raise TypeError(
            f"{cls.__name__}.apply: a Function with setup_context takes positional arguments "
            "only (setup_context receives them as the `inputs` tuple)"
        )
    output = cls.forward(*args)
    cls.setup_context(ctx, args, output)
    return output


def _apply_with_grad(cls: type[Function], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    node = cls._backward_cls.__new__(cls._backward_cls)
    edges: list[Edge] = []
    needs: list[bool] = []
    for arg in args:
        if isinstance(arg, Tensor) and arg._requires_grad:
            grad_fn = arg.grad_fn
            edges.append(
                (grad_fn, arg._output_nr)
                if grad_fn is not None
                else (arg._get_grad_accumulator(), 0)
            )
            needs.append(True)
            continue
        edges.append(_NO_EDGE)
        needs.append(False)
    Node.__init__(node, tuple(edges))
    node.needs_input_grad = tuple(needs)

    token = _grad_enabled.set(False)
    try:
        raw = cls._forward_with_ctx(node, *args, **kwargs)
    finally:
        _grad_enabled.reset(token)

    outputs = raw if type(raw) is tuple else (raw,)
    dirty = node.dirty_tensors
    non_diff = node.non_differentiable
    metadata = node._input_metadata
    output_nr = -1  # a counter, not enumerate(): once per op
    for out in outputs:
        output_nr += 1
        if not isinstance(out, Tensor):
            continue
        if dirty and any(out is d for d in dirty):
            check_inplace(out)
            out._bump_version()
        data = out.data
        dtype = data.dtype
        out_device = out.device
        metadata.append((data.shape, dtype, out_device))
        if node._stream is None and out_device.backend.has_streams:
            # As PyTorch: the node's stream is that of its outputs' device (where its
            # gradients arrive), current at forward; a copy to the CPU has none.
            node._stream = out_device.current_stream()
        if dtype.kind in "fc" and not (non_diff and any(out is n for n in non_diff)):
            out.grad_fn = node
            out._output_nr = output_nr
            out._requires_grad = True
    if _anomaly.get().enabled:
        node.metadata["traceback_"] = traceback.format_stack()[:-2]
        parent = current_node.get()
        if parent is not None:
            node.metadata["parent_"] = parent
    if node.to_save:
        node._save_variables(outputs)
    if dirty:
        _check_dirty_are_inputs(cls, dirty, args)
        for tensor in dirty:
            if tensor._base is not None and tensor.grad_fn is node:
                _rebase_view(tensor, node, args)
    return raw


def _rebase_view(view: Tensor, node: BackwardCFunction, args: tuple[Any, ...]) -> None:
    # Imported here: copy_slices uses built-in ops, which import this module.
    from aioautograd.autograd.copy_slices import rebase_view

    input_nr = next(i for i, arg in enumerate(args) if arg is view)
    rebase_view(view, node, input_nr)


def check_inplace(tensor: Tensor) -> None:
    """Raise PyTorch's error for an in-place op that autograd cannot record."""
    base = tensor._base
    if base is not None and base._requires_grad:
        if tensor.grad_fn is None:
            raise RuntimeError(
                "A view was created in no_grad mode and is being modified inplace with grad "
                "mode enabled. Given that this use case is ambiguous and error-prone, it is "
                "forbidden. You can clarify your code by moving both the view and the inplace "
                "either both inside the no_grad block (if you don't want the inplace to be "
                "tracked) or both outside (if you want the inplace to be tracked). (A view "
                "made before an in-place op through another view of the same base made the "
                "base require grad is reported here too: take the view again after that op.)"
            )
        if base.grad_fn is None:
            raise RuntimeError(
                "a view of a leaf Variable that requires grad is being used in an in-place "
                "operation. Do it under `with aioautograd.no_grad():` (as optimizers do) or "
                "clone() the leaf first."
            )
    elif tensor.grad_fn is None and tensor._requires_grad:
        raise RuntimeError(
            "a leaf Variable that requires grad is being used in an in-place operation. "
            "Do it under `with aioautograd.no_grad():` (as optimizers do) or clone() it first."
        )


def _check_dirty_are_inputs(cls: type[Function], dirty: tuple[Tensor, ...], args: Any) -> None:
    for tensor in dirty:
        if not any(tensor is arg for arg in args):
            raise RuntimeError(
                f"{cls.__name__}.forward passed to ctx.mark_dirty() a tensor that is not one of "
                "its inputs: mark_dirty() declares inputs that forward modified in place. "
                "Return a new tensor without marking it instead."
            )


def once_differentiable(
    backward: Callable[..., Any],
) -> Callable[..., Any]:
    """Decorate a ``Function.backward`` that cannot itself be differentiated.

    It runs with grad disabled; under ``create_graph=True`` its results are attached to an
    ``Error`` node, so a second differentiation fails with a clear message instead of
    silently returning wrong gradients.
    """

    @functools.wraps(backward)
    def wrapper(ctx: BackwardCFunction, *grads: Any) -> Any:
        token = _grad_enabled.set(False)
        try:
            result = backward(ctx, *grads)
        finally:
            _grad_enabled.reset(token)
        if not _grad_enabled.get():
            return result
        requires = [g for g in grads if isinstance(g, Tensor) and g._requires_grad]
        if not requires:
            return result
        error = Error(
            "trying to differentiate twice a function that was marked with @once_differentiable",
            tuple(g._gradient_edge() for g in requires),
        )
        outputs = result if isinstance(result, tuple) else (result,)
        for out in outputs:
            if isinstance(out, Tensor) and out.data.dtype.kind in "fc":
                out.grad_fn = error
                out._output_nr = error._add_input_metadata(out)
                out._requires_grad = True
        return result

    return wrapper
