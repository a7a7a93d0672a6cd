"""Custom differentiable functions: `Function`, `FunctionCtx` and `once_differentiable`.

As in PyTorch, each ``Function`` subclass gets a backward node class (``<Name>Backward``, or
``<Name>Backward0`` for the built-in ops) whose instances double as the ``ctx`` passed to
``forward`` and ``backward``. ``backward`` may be ``async def``: the engine then awaits it on
the event loop while the executors keep running other nodes.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

from aioautograd.anomaly_mode import _anomaly, current_node
from aioautograd.autograd.node import AccumulateGrad, Edge, Error, Grads, Node, _sequence_nr
from aioautograd.autograd.saved import (
    HookedSavedTensor,
    SavedTensor,
    saved_tensors_hooks_stack,
    second_backward_error,
)
from aioautograd.devices.device import CPU
from aioautograd.grad_mode import (
    _grad_enabled,
    _grad_enabled_get,
    _grad_enabled_reset,
    _grad_enabled_set,
)
from aioautograd.tensor import Tensor

EdgeRule = Literal["tensors", "differentiable", "operands"]

# Bound once (see grad_mode._grad_enabled_get): these run for every recorded op.
_anomaly_get = _anomaly.get
_saved_tensors_hooks_get = saved_tensors_hooks_stack.get
# Attribute loads on classes are not specialized by CPython 3.11: bound once too.
_new_object = object.__new__
_new_lock = threading.Lock


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

    # Counted at forward (``_apply_with_grad``) and read by inline pricing (engine/inline.py)
    # instead of the gradients' and edges' sizes at every backward: the elements of the
    # gradients the node reads (its tensor outputs') and writes (its inputs' that require
    # grad), negative when an output is not on the CPU. A gradient that does not arrive
    # (None) is counted all the same: an upper bound.
    __slots__ = ("_elements", "_leaves")

    _forward_cls: ClassVar[type[Function]]
    _saved: tuple[SavedTensor | None, ...] | None = ()
    _released: bool = False
    # The leaves its edges lead to (a leaf, or nested pairs of them), set only on a node
    # that has such edges and never read: their accumulators may hold them only weakly
    # (see AccumulateGrad), and a graph keeps its leaves alive.
    _leaves: Any

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
        # (saved.py's version check, written out: a call fewer per node with saved tensors)
        arrays: list[Any] = []
        for entry in saved:
            if entry is None:
                arrays.append(None)
            elif entry._counter.value != entry._saved_version:
                raise RuntimeError(entry._modified_message(self))
            else:
                tensor = entry._tensor
                arrays.append((entry.unpack(self) if tensor is None else tensor).data)
        return tuple(arrays)

    def apply(self, grads: Grads) -> Sequence[Tensor | None]:
        for grad in grads:  # (materialize_grads, a class attribute, read only when needed)
            if grad is None:
                if self.materialize_grads and _materialize(self, grads):
                    return (None,) * len(self._next_edges)
                break
        backward = self._forward_cls.backward
        result = backward(self, grads[0]) if len(grads) == 1 else backward(self, *grads)
        if type(result) is tuple:
            if len(result) == len(self._next_edges):
                return result
        elif type(result) is Tensor and len(self._next_edges) == 1:
            return (result,)  # (a unary op's one gradient)
        return _check_gradient_count(self, result)

    def release_variables(self) -> None:
        self._saved = None

    def _save_variables(self, outputs: tuple[Any, ...]) -> None:
        hooks = _saved_tensors_hooks_get()
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
                # (no generator for a single output: this runs for every saved tensor)
                is_output = tensor is outputs[0] or (
                    len(outputs) > 1 and any(tensor is out for out in outputs[1:])
                )
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


class _TensorArgsMixin:
    """Nodes of a ``Function`` applied to non-tensor arguments too: as in PyTorch, their
    ``next_functions`` hold one edge per tensor argument (per differentiable operand for the
    built-in ops), while ``backward`` still returns one gradient per ``forward`` argument."""

    _edge_args: tuple[int, ...]  # the argument each edge belongs to
    _num_args: int


class _TensorArgsBackward(_TensorArgsMixin, BackwardCFunction):
    def apply(self, grads: Grads) -> Sequence[Tensor | None]:
        for grad in grads:  # (materialize_grads, a class attribute, read only when needed)
            if grad is None:
                if self.materialize_grads and _materialize(self, grads):
                    return (None,) * len(self._next_edges)
                break
        backward = self._forward_cls.backward
        result = backward(self, grads[0]) if len(grads) == 1 else backward(self, *grads)
        if type(result) is tuple and len(result) == self._num_args:
            edge_args = self._edge_args
            if len(edge_args) == 1:
                return (result[edge_args[0]],)
            return tuple([result[i] for i in edge_args])
        return _select_edges(self, result)


class _AsyncTensorArgsBackward(_TensorArgsMixin, AsyncBackwardCFunction):
    async def apply(self, grads: Grads) -> Sequence[Tensor | None]:  # type: ignore[override]
        if self.materialize_grads:
            _materialize(self, grads)
        return _select_edges(self, await self._forward_cls.backward(self, *grads))


def _select_edges(node: Any, result: Any) -> Sequence[Tensor | None]:
    per_arg = _check_gradient_count(node, result, node._num_args)
    return tuple(per_arg[i] for i in node._edge_args)


def _materialize(node: BackwardCFunction, grads: Grads) -> bool:
    """Replace ``None`` gradients by zeros of the shapes the node's inputs have (not for
    non-tensor outputs: those stay ``None``).

    Returns True, materializing nothing, for a built-in op that received no gradient at
    all: as PyTorch's generated nodes, it then returns ``None`` for every input instead of
    propagating zeros (so ``.grad`` stays ``None`` behind a custom backward returning
    ``None``).
    """
    if node.inline and all(grad is None for grad in grads):
        return True
    for i, grad in enumerate(grads):
        if grad is None:
            shape, dtype, device = node._input_metadata[i]
            if device is not None:
                grads[i] = Tensor(device.xp.zeros(shape, dtype), device)
    return False


def _check_gradient_count(
    node: BackwardCFunction, result: Any, expected: int | None = None
) -> Sequence[Tensor | None]:
    grads: tuple[Tensor | None, ...] = result if isinstance(result, tuple) else (result,)
    if expected is None:
        expected = len(node._next_edges)
    if len(grads) != expected:
        if len(grads) > expected and all(r is None for r in grads[expected:]):
            return grads[:expected]
        raise RuntimeError(
            f"function {node.name()} returned an incorrect number of gradients "
            f"(expected {expected}, got {len(grads)})"
        )
    return grads


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

    ``backward`` returns one gradient (or ``None``) per ``forward`` argument; the node's
    ``next_functions`` have one edge per tensor argument, as in PyTorch. ``forward`` may
    return non-tensor values among its outputs (``backward`` gets ``None`` for them); an
    input returned unchanged comes back as a view of it.
    """

    _backward_cls: ClassVar[type[BackwardCFunction]]
    _tensor_args_backward_cls: ClassVar[type[BackwardCFunction] | None]
    # ``forward`` itself, or ``forward`` then ``setup_context`` (set per subclass).
    _forward_with_ctx: ClassVar[Callable[..., Any]]
    # Built-in ops name their nodes like PyTorch's generated ones: ``MulBackward0``.
    _node_suffix: ClassVar[str] = "Backward"
    # Whether the backward runs only library code (built-in ops), so that the engine may
    # run the node inline on the awaiting thread; user Functions run on the executors.
    _inline_backward: ClassVar[bool] = False
    # A built-in op whose backward is matrix products: per argument, the axis its products
    # contract (``Node._product_axes``), so that inline execution prices the node by flops;
    # one whose backward is dear per element: how dear (``Node._element_cost``).
    _product_axes: ClassVar[tuple[int | None, ...] | None] = None
    _element_cost: ClassVar[int] = 1
    # Which arguments get a ``next_functions`` edge. "tensors" (PyTorch's rule for custom
    # Functions): every tensor. Built-in ops: "differentiable", floating point tensors only
    # (an index or a mask is not differentiable), or "operands", those and the non-tensor
    # operands too, which PyTorch wraps into tensors (``x * 2`` has two edges).
    _edge_rule: ClassVar[EdgeRule] = "tensors"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        is_async = inspect.iscoroutinefunction(inspect.unwrap(cls.backward))
        base = AsyncBackwardCFunction if is_async else BackwardCFunction
        attrs = {
            "_forward_cls": cls,
            "inline": cls._inline_backward and not is_async,
            "_product_axes": cls._product_axes,
            "_element_cost": cls._element_cost,
        }
        name = cls.__name__ + cls._node_suffix
        cls._backward_cls = type(name, (base,), attrs)
        cls._tensor_args_backward_cls = None  # made on first use
        if cls.setup_context is Function.setup_context:
            cls._forward_with_ctx = cls.forward
        else:
            cls._forward_with_ctx = staticmethod(functools.partial(_forward_then_setup, cls))

    @classmethod
    def _tensor_args_node_cls(cls) -> type[BackwardCFunction]:
        """The node class with edges for some arguments only (see _TensorArgsMixin)."""
        node_cls = cls._tensor_args_backward_cls
        if node_cls is None:
            node_cls = cls._tensor_args_backward_cls = type(
                cls._backward_cls.__name__,
                (
                    _AsyncTensorArgsBackward if cls._backward_cls.is_async else _TensorArgsBackward,
                    cls._backward_cls,
                ),
                {},
            )
        return node_cls

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
        if _grad_enabled_get():
            for arg in args:
                if isinstance(arg, Tensor) and arg._requires_grad:
                    return _apply_with_grad(cls, args, kwargs)
        ctx = FunctionCtx()
        try:
            outputs = cls._forward_with_ctx(ctx, *args, **kwargs)
        except ValueError as exc:
            raise _broadcast_error(cls, args, exc) from exc
        for tensor in ctx.dirty_tensors:
            if not args or tensor is not args[0]:
                _check_dirty_are_inputs(cls, (tensor,), args)
            tensor._bump_version()
        return outputs


_NO_EDGE: Edge = (None, 0)
# ``BackwardCFunction._elements`` of a node with an output off the CPU: negative whatever
# is added to it.
_UNCOUNTED = -(1 << 62)
# The input metadata of an output that is not a tensor (its device None: nothing to make).
_NOT_A_TENSOR: Any = ((), None, None)


def _broadcast_error(cls: type[Function], args: tuple[Any, ...], exc: ValueError) -> Exception:
    """NumPy's broadcasting ValueError as PyTorch's RuntimeError naming the op and the
    mismatched dimension; any other ValueError unchanged."""
    if "broadcast" not in str(exc):
        return exc
    shapes = [tuple(arg.shape) for arg in args if isinstance(arg, Tensor)]
    shapes += [
        tuple(arg.shape) for arg in args if getattr(arg, "ndim", 0) and not isinstance(arg, Tensor)
    ]
    detail = ""
    for i, j in itertools.combinations(range(len(shapes)), 2):
        a, b = shapes[i], shapes[j]
        ndim = max(len(a), len(b))
        for dim in range(1, ndim + 1):
            size_a = a[-dim] if dim <= len(a) else 1
            size_b = b[-dim] if dim <= len(b) else 1
            if size_a != size_b and 1 not in (size_a, size_b):
                detail = (
                    f": the size of tensor {'abc'[i]} ({size_a}) must match the size of tensor "
                    f"{'abc'[j]} ({size_b}) at non-singleton dimension {ndim - dim}"
                )
                break
        if detail:
            break
    listed = " and ".join(str(shape) for shape in shapes)
    return RuntimeError(
        f"{cls.__name__.lower()}: shapes {listed} cannot be broadcast together{detail}. "
        "Dimensions are matched from the right and must be equal or 1: reshape, unsqueeze "
        "or expand an operand to make them match."
    )


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
    edges: list[Edge] = []
    needs: list[bool] = []
    skipped: list[int] | None = None  # the arguments that get no edge (see _edge_rule)
    plain_input = False  # a tensor argument that does not require grad
    topo = 0  # (Node.__init__'s topological_nr, found in this loop)
    elements = 0  # of the gradients the node writes and reads (BackwardCFunction._elements)
    leaves: Any = None  # the leaves that get an edge (BackwardCFunction._leaves)
    for arg in args:
        if isinstance(arg, Tensor):
            if arg._requires_grad:
                elements += arg.data.size
                grad_fn = arg.grad_fn
                if grad_fn is not None:
                    edges.append((grad_fn, arg._output_nr))
                    if grad_fn.topological_nr >= topo:
                        topo = grad_fn.topological_nr + 1
                else:
                    acc = arg._grad_accumulator  # (owned by the leaf: see AccumulateGrad)
                    if type(acc) is not AccumulateGrad:
                        acc = arg._owned_grad_accumulator()
                    edges.append((acc, 0))
                    # The node holds the leaf: an owned accumulator holds it weakly.
                    leaves = arg if leaves is None else (leaves, arg)
                    if not topo:
                        topo = 1  # (an accumulator's topological_nr is 0)
                needs.append(True)
                continue
            plain_input = True
            needs.append(False)
            if cls._edge_rule != "tensors" and arg.data.dtype.kind not in "fc":
                skipped = [len(needs) - 1] if skipped is None else [*skipped, len(needs) - 1]
                continue
        else:
            needs.append(False)
            if cls._edge_rule != "operands":
                skipped = [len(needs) - 1] if skipped is None else [*skipped, len(needs) - 1]
                continue
        edges.append(_NO_EDGE)
    if skipped is None:
        node = _new_object(cls._backward_cls)
    else:
        node_cls = cls._tensor_args_backward_cls or cls._tensor_args_node_cls()
        node = _new_object(node_cls)
        node._edge_args = tuple(i for i in range(len(args)) if i not in skipped)  # type: ignore[attr-defined]
        node._num_args = len(args)  # type: ignore[attr-defined]
    # Node.__init__'s fields, set here (once per recorded op: a call fewer)
    node._next_edges = tuple(edges)
    node.topological_nr = topo
    node.sequence_nr = next(_sequence_nr)
    node._input_metadata = []
    node._lock = _new_lock()
    node.needs_input_grad = tuple(needs)
    if leaves is not None:
        node._leaves = leaves

    token = _grad_enabled_set(False)
    try:
        raw = cls._forward_with_ctx(node, *args, **kwargs)
    except ValueError as exc:
        raise _broadcast_error(cls, args, exc) from exc
    finally:
        _grad_enabled_reset(token)

    outputs = raw if type(raw) is tuple else (raw,)
    dirty = node.dirty_tensors
    non_diff = node.non_differentiable
    metadata = node._input_metadata
    replaced: list[Any] | None = None
    output_nr = -1  # a counter, not enumerate(): once per op
    for out in outputs:
        output_nr += 1
        if not isinstance(out, Tensor):
            # A slot all the same (PyTorch's): backward gets None for it.
            metadata.append(_NOT_A_TENSOR)
            continue
        if out._requires_grad or plain_input or dirty:  # it may be one of the inputs
            adopted = _adopt_input(node, out, output_nr, args, dirty)
            if adopted is not out:
                if replaced is None:
                    replaced = list(outputs)
                replaced[output_nr] = out = adopted
        data = out.data
        dtype = data.dtype
        out_device = out.device
        metadata.append((data.shape, dtype, out_device))
        elements += data.size  # (a gradient the node reads)
        if out_device is not CPU:
            elements = _UNCOUNTED
            if node._stream is None and out_device.backend.has_streams:
                # As PyTorch: the node's stream is that of its outputs' device (where its
                # gradients arrive), current at forward; a copy to the CPU has none.
                node._stream = out_device.current_stream()
                node._plain = 0
        if dtype.kind in "fc" and not (non_diff and any(out is n for n in non_diff)):
            out.grad_fn = node
            out._output_nr = output_nr
            out._requires_grad = True
    node._elements = elements
    if replaced is not None:
        outputs = tuple(replaced)
        raw = outputs if type(raw) is tuple else outputs[0]
    if _anomaly_get().enabled:
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


def _adopt_input(
    node: BackwardCFunction,
    out: Tensor,
    output_nr: int,
    args: tuple[Any, ...],
    dirty: tuple[Tensor, ...],
) -> Tensor:
    """The tensor to record as output ``output_nr`` when ``out`` may be an input.

    A modified input (``mark_dirty``) is the output itself, one version later; its
    ``retain_grad`` moves to the new node. An input returned unchanged becomes a view of
    it, as in PyTorch, so that the input keeps its own history (a leaf stays a leaf).
    """
    for tensor in dirty:
        if out is tensor:
            check_inplace(out)
            out._bump_version()
            if out._retains_grad:
                old = out.grad_fn
                if old is not None:
                    old._unset_retains_grad(out._output_nr)
                node._set_retains_grad(output_nr, out)
            return out
    for arg in args:
        if out is arg:
            view: Tensor = out._view_of(out.data)
            return view
    return out


def _rebase_view(view: Tensor, node: BackwardCFunction, args: tuple[Any, ...]) -> None:
    # Imported here: copy_slices uses built-in ops, which import this module.
    from aioautograd.ops.copy_slices import rebase_view

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
        if not any(isinstance(g, Tensor) and g._requires_grad for g in grads):
            return result
        # As PyTorch: the results are new tensors hanging off an error node whose inputs
        # are fresh leaves (detached aliases), not the incoming gradients' graph; reaching
        # that node raises.
        outputs = list(result) if isinstance(result, tuple) else [result]
        positions = [
            i
            for i, out in enumerate(outputs)
            if isinstance(out, Tensor) and out.data.dtype.kind in "fc"
        ]
        error = Error(
            "trying to differentiate twice a function that was marked with @once_differentiable",
            tuple(
                (outputs[i].detach().requires_grad_()._get_grad_accumulator(), 0) for i in positions
            ),
        )
        for i in positions:
            out = outputs[i].detach()
            out.grad_fn = error
            out._output_nr = error._add_input_metadata(out)
            out._requires_grad = True
            outputs[i] = out
        return tuple(outputs) if isinstance(result, tuple) else outputs[0]

    return wrapper
