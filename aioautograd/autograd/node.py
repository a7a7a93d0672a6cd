"""Nodes of the backward graph: `Node`, `GraphRoot`, `AccumulateGrad` and `Error`.

A node's *inputs* are the gradients of its forward outputs; its *outputs* are the gradients
of its forward inputs, sent along ``next_functions`` edges ``(node, input_nr)``. Each node
records the metadata (shape, dtype, device) of every input so that the engine can validate
the gradients flowing into it.
"""

from __future__ import annotations

import itertools
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Final, NamedTuple

from aioautograd.autograd.hooks import HookDict, RemovableHandle, flag_lock
from aioautograd.grad_mode import _grad_enabled_get

if TYPE_CHECKING:
    from aioautograd._typing import Shape
    from aioautograd.devices.device import Device
    from aioautograd.devices.streams import Stream
    from aioautograd.tensor import Tensor

Edge = tuple["Node | None", int]
InputMetadata = tuple["Shape", Any, "Device"]
Grads = list["Tensor | None"]

_sequence_nr = itertools.count()
# AccumulateGrad runs as soon as it is ready (PyTorch gives it UINT64_MAX).
_ACCUMULATE_SEQUENCE_NR = sys.maxsize
# Guards a leaf's ``_grad_accumulator`` while it is made or changes hands (tensor.py).
accumulator_lock = threading.Lock()


# ``Node._plain``: 0, PLAIN, INLINE or PRICED. PLAIN: no hook of any kind (node pre- and
# post-hooks, tensor hooks, retain_grad; for a leaf's node the leaf's hooks and
# post-accumulate hooks), no stream, not async, so evaluate_function's hot path may run it.
# INLINE: all that, and its class runs only library code (``Node.inline``), so inline
# execution may take it, priced by its gradients' elements. PRICED: INLINE, but its class
# has a cost model of its own (matrix products: ``Node._product_axes``; element-wise work
# far dearer than a multiplication per element: ``Node._element_cost``). Kept current by
# every registration and removal (``_refresh_plain``): the engine reads one slot per node
# instead of six attributes of several node types at one site (reads CPython 3.11 does not
# specialize).
PLAIN: Final = 1
INLINE: Final = 2
PRICED: Final = 3


def next_sequence_nr() -> int:
    return next(_sequence_nr)


class Node:
    """A function of the backward graph (PyTorch's ``torch.autograd.graph.Node``).

    Attributes:
        sequence_nr: creation order; the engine runs later-created nodes first.
        topological_nr: length of the longest path from this node to a leaf.
    """

    # The hooks, the stream and the flag are class-level defaults, set on an instance only
    # when they change (a hook registered, a stream at forward): a node is made per op of
    # every forward pass, and each attribute stored there costs (``chain_forward``).
    __slots__ = (
        "__dict__",
        "__weakref__",
        "_input_metadata",
        "_lock",
        "_next_edges",
        "sequence_nr",
        "topological_nr",
    )

    sequence_nr: int
    topological_nr: int
    # True for nodes whose ``apply`` is a coroutine function (awaited on the event loop).
    is_async: ClassVar[bool] = False
    # True for nodes that run no user code (built-in ops): the engine may run them inline
    # on the thread that awaits the backward (see engine/inline.py).
    inline: ClassVar[bool] = False
    # For a node whose backward is matrix products (matmul, linear), one entry per forward
    # argument: the axis of that argument's shape that the products contract (a 1-D
    # operand's only axis when it has no such axis), None for an argument whose gradient
    # is no product. Inline execution prices such a node by its flops (engine/inline.py).
    _product_axes: ClassVar[tuple[int | None, ...] | None] = None
    # How many element-wise operations of a multiplication's cost each element of this
    # node's gradients costs (GELU's backward evaluates the error function: ~50 NumPy
    # passes). Inline execution counts its elements this many times (engine/inline.py).
    _element_cost: ClassVar[int] = 1
    # The elements of the gradients it reads and writes, counted at its creation (a
    # ``Function``'s node: function.BackwardCFunction); negative: not counted, inline
    # pricing reads them from the gradients and the edges' metadata.
    _elements: int = -1
    # 0, PLAIN, INLINE or PRICED (see above): each class's own from ``is_async``,
    # ``inline``, ``_product_axes`` and ``_element_cost``; an instance's only while a hook
    # or stream is set.
    _plain: int = PLAIN
    _pre_hooks: HookDict | None = None
    _post_hooks: HookDict | None = None
    _tensor_pre_hooks: dict[int, HookDict] | None = None
    _retains_grad_hooks: dict[int, weakref.ReferenceType[Tensor]] | None = None
    _metadata: dict[str, Any] | None = None
    # The stream current at forward on an accelerator; backward runs on it.
    _stream: Stream | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.is_async:
            cls._plain = 0
        elif cls.inline:
            priced = cls._product_axes is not None or cls._element_cost != 1
            cls._plain = PRICED if priced else INLINE
        else:
            cls._plain = PLAIN

    def __init__(self, next_edges: tuple[Edge, ...] = (), sequence_nr: int | None = None) -> None:
        # (``function._apply_with_grad`` sets these fields itself for a Function's node, a
        # call fewer per recorded op: keep the two in step)
        self._next_edges = next_edges
        topo = 0
        for next_node, _ in next_edges:
            if next_node is not None and next_node.topological_nr >= topo:
                topo = next_node.topological_nr + 1
        self.topological_nr = topo
        self.sequence_nr = next(_sequence_nr) if sequence_nr is None else sequence_nr
        self._input_metadata: list[InputMetadata] = []
        # The engine holds it while applying the node: never two graph tasks at once.
        self._lock = threading.Lock()

    # --------------------------------------------------------------------- public API
    def name(self) -> str:
        """The node's name, as PyTorch prints it (``MulBackward0``)."""
        return type(self).__name__

    @property
    def next_functions(self) -> tuple[Edge, ...]:
        """``((node, input_nr), ...)``: where each output gradient flows."""
        edges = self._next_edges
        for next_node, _ in edges:
            if type(next_node) is AccumulateGrad and next_node._strong is None:
                next_node._expose()  # the user may keep it: PyTorch's lifetimes
        return edges

    @property
    def stream(self) -> Stream | None:
        """The stream this node's backward runs on (``None`` for CPU nodes)."""
        return self._stream

    @property
    def metadata(self) -> dict[str, Any]:
        """A dict for user data (anomaly mode stores the forward traceback here)."""
        if self._metadata is None:
            self._metadata = {}
        return self._metadata

    def input_metadata(self, index: int) -> InputMetadata:
        """``(shape, dtype, device)`` of the ``index``-th input (forward output)."""
        return self._input_metadata[index]

    @property
    def num_inputs(self) -> int:
        return len(self._input_metadata)

    @property
    def num_outputs(self) -> int:
        return len(self._next_edges)

    def register_hook(
        self, hook: Callable[[tuple[Tensor | None, ...], tuple[Tensor | None, ...]], Any]
    ) -> RemovableHandle:
        """Register ``hook(grad_inputs, grad_outputs)`` run after the node.

        ``grad_inputs`` are the gradients the node computed (for its forward inputs) and
        ``grad_outputs`` those it received. The hook may return replacement ``grad_inputs``.
        """
        if self._post_hooks is None:
            self._post_hooks = HookDict(self)
        return RemovableHandle(self._post_hooks, hook)

    def register_prehook(self, hook: Callable[[tuple[Tensor | None, ...]], Any]) -> RemovableHandle:
        """Register ``hook(grad_outputs)`` run before the node; may return replacements."""
        if self._pre_hooks is None:
            self._pre_hooks = HookDict(self)
        return RemovableHandle(self._pre_hooks, hook)

    def __call__(self, *grads: Tensor | None) -> Any:
        outputs = self.apply(list(grads))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def __repr__(self) -> str:
        return f"<{self.name()} object at {id(self):#x}>"

    # ------------------------------------------------------------- engine interface
    def apply(self, grads: Grads) -> Sequence[Tensor | None]:
        """Compute output gradients from input gradients (one per ``next_functions`` edge)."""
        raise NotImplementedError(f"{self.name()} does not implement apply()")

    def release_variables(self) -> None:
        """Free saved tensors (called after backward unless ``retain_graph=True``)."""

    def _hooked(self) -> bool:
        """Whether a hook of any kind, or retain_grad, is registered on this node."""
        tensor_hooks = self._tensor_pre_hooks
        return bool(
            self._pre_hooks
            or self._post_hooks
            or self._retains_grad_hooks
            or (tensor_hooks and any(tensor_hooks.values()))
        )

    def _clear_plain(self) -> None:
        """(``HookDict``'s owner) A hook is being registered: off the fast path."""
        self._plain = 0

    def _refresh_plain(self) -> None:
        """Recompute ``_plain`` (after a hook's removal, or a stream's assignment)."""
        if self.is_async or self._stream is not None or self._hooked():
            self._plain = 0
        else:
            self._plain = type(self)._plain  # (the class's own: see __init_subclass__)

    def _register_tensor_pre_hook(
        self, input_nr: int, hook: Callable[[Tensor], Tensor | None]
    ) -> RemovableHandle:
        if self._tensor_pre_hooks is None:
            self._tensor_pre_hooks = {}
        hooks = self._tensor_pre_hooks.get(input_nr)
        if hooks is None:
            hooks = self._tensor_pre_hooks[input_nr] = HookDict(self)
        return RemovableHandle(hooks, hook)

    def _set_retains_grad(self, input_nr: int, tensor: Tensor) -> None:
        with flag_lock:
            self._plain = 0
            if self._retains_grad_hooks is None:
                self._retains_grad_hooks = {}
            self._retains_grad_hooks[input_nr] = weakref.ref(tensor)

    def _unset_retains_grad(self, input_nr: int) -> None:
        if self._retains_grad_hooks:
            with flag_lock:
                self._retains_grad_hooks.pop(input_nr, None)
                self._refresh_plain()

    def _add_input_metadata(self, tensor: Tensor) -> int:
        self._input_metadata.append((tensor.data.shape, tensor.data.dtype, tensor.device))
        return len(self._input_metadata) - 1


class GradientEdge(NamedTuple):
    """Where a gradient enters the graph: input ``output_nr`` of ``node`` (PyTorch's
    ``torch.autograd.graph.GradientEdge``). Get one with ``graph.get_gradient_edge(t)``;
    ``grad(outputs, inputs=edge)`` differentiates with respect to it, even after the tensor
    it came from was modified in place or freed."""

    node: Node
    output_nr: int


class GraphRoot(Node):
    """The node the engine starts from: it emits the root gradients along its edges."""

    __slots__ = ("_grads",)
    inline = True

    def __init__(self, edges: tuple[Edge, ...], grads: Grads) -> None:
        super().__init__(edges, sequence_nr=_ACCUMULATE_SEQUENCE_NR)
        self._grads = grads

    def apply(self, grads: Grads) -> Sequence[Tensor | None]:
        return self._grads


class AccumulateGrad(Node):
    """Accumulates the incoming gradient into ``variable.grad`` (one per leaf tensor).

    Thread-safe: the node lock serialises writers, including concurrent graph tasks.
    Without ``create_graph`` the gradient buffer is reused when nothing else references it
    (PyTorch's "steal") and later gradients are added in place; with ``create_graph`` the
    sum is recorded in the graph.

    Lifetimes (PyTorch's, kept): a graph keeps its leaves alive, and a leaf's node lives
    as long as a graph or the user holds it, hooks registered on it included. Two ways to
    get there. A node the user can reach (``next_functions``, ``get_gradient_edge``, a
    root or ``inputs=`` edge) is *exposed*: it holds its leaf strongly and the leaf holds
    it weakly, as in PyTorch. A node only the engine reaches (a CPU leaf's, made by
    ``Function.apply``, whose node also holds the leaf) is *owned* by its leaf: the leaf
    holds it strongly and it holds the leaf weakly (no cycle), so that one node serves
    every forward pass instead of a node, a lock and a weak reference made per leaf per
    step. ``_expose`` turns an owned node into an exposed one, the way it would have been.
    """

    __slots__ = ("_ref", "_strong")
    inline = True

    def __init__(self, variable: Tensor, owned: bool = False) -> None:
        # Node.__init__'s fields, set here: no edges, and the input metadata and tensor
        # hooks are read from the leaf (their setters do nothing).
        self._next_edges = ()
        self.topological_nr = 0
        self.sequence_nr = _ACCUMULATE_SEQUENCE_NR
        self._lock = threading.Lock()
        # The engine reads the leaf through ``_ref`` (a C call, no property): alive while
        # a graph reaches this node, since whatever holds the node then holds the leaf.
        self._ref: Callable[[], Tensor] = weakref.ref(variable)  # type: ignore[assignment]
        self._strong: Tensor | None = None if owned else variable
        device = variable.device
        if device.backend.has_streams:
            self._stream = device.current_stream()
        if (
            self._stream is not None
            or variable._backward_hooks
            or variable._post_accumulate_grad_hooks
        ):
            self._plain = 0

    @property
    def variable(self) -> Tensor:
        """The leaf tensor this node accumulates into."""
        return self._ref()

    def _expose(self) -> None:
        """Hold the leaf strongly and let it hold this node weakly (PyTorch's lifetimes):
        what any node the user, a root or a ``grad()`` input can reach must be."""
        if self._strong is not None:
            return
        with accumulator_lock:
            variable = self._ref()
            if self._strong is None and variable is not None:
                self._strong = variable
                if variable._grad_accumulator is self:
                    variable._grad_accumulator = weakref.ref(self)

    @property
    def _input_metadata(self) -> list[InputMetadata]:
        # Read live: users may rebind ``leaf.data``.
        variable = self._ref()  # (the property, without its call)
        return [(variable.data.shape, variable.data.dtype, variable.device)]

    @_input_metadata.setter
    def _input_metadata(self, value: list[InputMetadata]) -> None:
        pass  # derived from the variable (nothing to store)

    @property
    def _tensor_pre_hooks(self) -> dict[int, HookDict] | None:
        # The leaf's hooks (``Tensor.register_hook``), read live; None while it has none, so
        # that the engine's hot path takes the node (as any node without hooks).
        hooks = self._ref()._backward_hooks
        return {0: hooks} if hooks else None

    @_tensor_pre_hooks.setter
    def _tensor_pre_hooks(self, value: dict[int, HookDict] | None) -> None:
        pass  # derived from the variable (nothing to store)

    def _hooked(self) -> bool:
        variable = self._ref()
        return bool(
            self._pre_hooks
            or self._post_hooks
            or variable._backward_hooks
            or variable._post_accumulate_grad_hooks
        )

    def apply(self, grads: Grads) -> Sequence[Tensor | None]:
        grad = grads[0]
        grads[0] = None  # drop the buffer's reference so the gradient can be stolen
        variable = self._ref()  # (alive: see the class)
        if grad is not None:
            # PyTorch's AccumulateGrad rules (here, not in a function of their own: one call
            # fewer per leaf). The engine holds this node's lock while applying it: one
            # writer per leaf.
            old = variable._grad
            if _grad_enabled_get():  # create_graph: keep the accumulation differentiable
                # A first gradient is copied differentiably (PyTorch's CopyBackwards node),
                # so .grad never aliases a tensor of the graph.
                variable._grad = grad._copy_grad() if old is None else old + grad
            elif old is None:
                # Kept without a copy when nothing else references it (PyTorch's
                # AccumulateGrad "steals" it the same way); the reference: our local.
                variable._grad = grad if owned_gradient(grad, 1) else _detached_copy(grad)
            elif old.grad_fn is None and _writeable(old.data):
                old.xp.add(old.data, grad.data, out=old.data)
                old._bump_version()
            else:
                variable._grad = _detached_copy(old + grad)
        hooks = variable._post_accumulate_grad_hooks
        if hooks:  # (run when no gradient arrived too, as in PyTorch)
            for hook in tuple(hooks.values()):
                if hook(variable) is not None:
                    raise RuntimeError(
                        "Tensor post accumulate grad hooks should return None: they may "
                        "read or modify tensor.grad in place, not replace it"
                    )
        return ()


# The references an owned gradient's array has: the tensor's ``data`` slot, the local
# ``data`` and ``getrefcount``'s argument.
_OWNED_ARRAY_REFS = 3


def owned_gradient(grad: Tensor, refs: int) -> bool:
    """True when the caller's frames hold the only ``refs`` references to ``grad`` and
    nothing else references it or its array, so that a backward formula may write its result
    into the gradient's memory (what hand-written code does with ``grad *= mask``).

    ``refs`` counts the references as CPython 3.11 does, this function's own left out;
    ``tests/engine/test_gradient_stealing.py`` pins them on the running version, both ways.
    """
    data = grad.data
    return (
        grad.grad_fn is None
        and grad._base is None
        and data.base is None
        and sys.getrefcount(grad) <= refs + 2  # (this function's parameter, getrefcount's)
        and sys.getrefcount(data) <= _OWNED_ARRAY_REFS
        and getattr(data.flags, "writeable", True)  # (_writeable, inlined: once per leaf)
    )


def _writeable(array: Any) -> bool:
    # CuPy's flags have no ``writeable``: its arrays always are.
    return bool(getattr(array.flags, "writeable", True))


def _detached_copy(tensor: Tensor) -> Tensor:
    return tensor._new(tensor.data.copy())


class Error(Node):
    """A node that raises when the engine reaches it (e.g. double backward through a
    ``once_differentiable`` function)."""

    __slots__ = ("message",)

    def __init__(self, message: str, next_edges: tuple[Edge, ...]) -> None:
        super().__init__(next_edges)
        self.message = message

    def apply(self, grads: Grads) -> Sequence[Tensor | None]:
        raise RuntimeError(self.message)
