"""`Tensor`: an array (NumPy or CuPy) plus the autograd metadata PyTorch users expect.

The operators below are thin: each calls a `Function` in `aioautograd.ops`.
"""

from __future__ import annotations

import builtins
import warnings
import weakref
from collections.abc import Callable, Coroutine, Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from aioautograd._typing import Array, DTypeLike, Shape
from aioautograd.devices.device import CPU, Device, is_device_spec
from aioautograd.devices.device import device as _as_device

if TYPE_CHECKING:
    from aioautograd.autograd.node import Node


class VersionCounter:
    """Counts in-place modifications; shared by a tensor and its views (and ``detach()``)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


def _dtype(dtype: DTypeLike) -> np.dtype[Any] | None:
    return None if dtype is None else np.dtype(dtype)


class Tensor:
    """A multi-dimensional array that can record the operations applied to it.

    Create tensors with :func:`aioautograd.tensor` and the other factories. ``data`` is the
    underlying ``numpy.ndarray`` (or ``cupy.ndarray`` on ``cuda`` devices).
    """

    __slots__ = (
        "__weakref__",
        "_backward_hooks",
        "_base",
        "_grad",
        "_grad_accumulator",
        "_output_nr",
        "_post_accumulate_grad_hooks",
        "_requires_grad",
        "_retains_grad",
        "_version_counter",
        "data",
        "device",
        "grad_fn",
    )

    data: Array
    device: Device
    grad_fn: Node | None

    # Tensors hash by identity (as in PyTorch) even though == is elementwise.
    __hash__ = object.__hash__
    # Make NumPy defer to our reflected operators (ndarray + Tensor -> Tensor.__radd__).
    __array_priority__ = 1000

    def __init__(
        self, data: Array, device: Device = CPU, requires_grad: builtins.bool = False
    ) -> None:
        self.data = data
        self.device = device
        self._requires_grad = requires_grad
        self._grad: Tensor | None = None
        self.grad_fn = None
        self._output_nr = 0
        self._version_counter: VersionCounter | None = None
        self._base: Tensor | None = None
        self._retains_grad = False
        self._backward_hooks: HookDict | None = None
        self._post_accumulate_grad_hooks: HookDict | None = None
        self._grad_accumulator: Any = None

    # ----------------------------------------------------------------- construction helpers
    def _new(self, data: Array) -> Tensor:
        """A new tensor on this tensor's device holding ``data`` (no autograd history)."""
        return Tensor(data, self.device)

    def _view_of(self, data: Array) -> Tensor:
        """A tensor holding ``data``, a view of this tensor's data: shares its version counter."""
        out = Tensor(data, self.device)
        out._version_counter = self._ensure_version_counter()
        out._base = self if self._base is None else self._base
        return out

    def _ensure_version_counter(self) -> VersionCounter:
        counter = self._version_counter
        if counter is None:
            counter = self._version_counter = VersionCounter()
        return counter

    def _bump_version(self) -> None:
        counter = self._version_counter
        if counter is None:
            counter = self._version_counter = VersionCounter()
        counter.value += 1

    @property
    def _version(self) -> builtins.int:
        """The number of in-place modifications seen by this tensor's storage."""
        counter = self._version_counter
        return 0 if counter is None else counter.value

    @property
    def xp(self) -> Any:
        """The array module of this tensor's device (``numpy`` or ``cupy``)."""
        return self.device.xp

    # ------------------------------------------------------------------------- attributes
    @property
    def shape(self) -> Shape:
        # Array is Any (NumPy or CuPy); no typed local on these hot properties.
        return self.data.shape  # type: ignore[no-any-return]

    def size(self, dim: builtins.int | None = None) -> Any:
        """The shape, or the length of dimension ``dim`` (PyTorch's ``Tensor.size``)."""
        return self.data.shape if dim is None else self.data.shape[dim]

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.data.dtype  # type: ignore[no-any-return]

    @property
    def ndim(self) -> builtins.int:
        return self.data.ndim  # type: ignore[no-any-return]

    def dim(self) -> builtins.int:
        return self.data.ndim  # type: ignore[no-any-return]

    def numel(self) -> builtins.int:
        return int(self.data.size)

    def __len__(self) -> builtins.int:
        if self.data.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return int(self.data.shape[0])

    @property
    def is_cuda(self) -> builtins.bool:
        return self.device.type == "cuda"

    @property
    def requires_grad(self) -> builtins.bool:
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, value: builtins.bool) -> None:
        if self.grad_fn is not None:
            raise RuntimeError(
                "you can only change requires_grad flags of leaf variables. If you want to use "
                "a computed variable in a subgraph that doesn't require differentiation use "
                "var_no_grad = var.detach()."
            )
        if value and self.data.dtype.kind not in "fc":
            raise RuntimeError(
                "only Tensors of floating point dtype can require gradients "
                f"(this tensor is {self.data.dtype}); convert it with .float() or .double() first"
            )
        self._requires_grad = bool(value)

    def requires_grad_(self, requires_grad: builtins.bool = True) -> Tensor:
        """Set ``requires_grad`` in place and return ``self``.

        On a non-leaf tensor (which requires grad already) only ``requires_grad_(True)``
        is allowed, and does nothing, as in PyTorch.
        """
        if requires_grad and self.grad_fn is not None:
            return self
        self.requires_grad = requires_grad
        return self

    @property
    def is_leaf(self) -> builtins.bool:
        """True for tensors created by the user (no ``grad_fn``)."""
        return self.grad_fn is None

    @property
    def output_nr(self) -> builtins.int:
        return self._output_nr

    @property
    def retains_grad(self) -> builtins.bool:
        return self._retains_grad

    @property
    def T(self) -> Tensor:
        return shape_ops.permute(self, tuple(range(self.ndim - 1, -1, -1)))

    @property
    def mT(self) -> Tensor:
        return shape_ops.transpose(self, -2, -1)

    @property
    def grad(self) -> Tensor | None:
        """The accumulated gradient (``None`` until a backward pass reaches this leaf).

        Non-leaf tensors have one only after :meth:`retain_grad`; reading it otherwise
        warns, as in PyTorch.

        Raises:
            RuntimeError: when this task called ``backward()`` without ``await``.
        """
        if _pending.items:
            check_awaited()
        grad = self._grad
        if grad is None and self.grad_fn is not None and not self._retains_grad:
            warnings.warn(
                "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed. "
                "backward() does not populate it; call .retain_grad() on the tensor before "
                "backward if you want it, or read .grad of the leaf tensor instead.",
                UserWarning,
                stacklevel=2,
            )
        return grad

    @grad.setter
    def grad(self, value: Tensor | None) -> None:
        if value is not None:
            _check_grad_assignment(self, value)
        self._grad = value

    @grad.deleter
    def grad(self) -> None:
        self._grad = None

    def data_ptr(self) -> builtins.int:
        """The address of this tensor's first element (views of one storage differ by
        their offset, as in PyTorch)."""
        return _data_ptr(self.data)

    # ---------------------------------------------------------------------- graph access
    def _gradient_edge(self) -> tuple[Node, builtins.int]:
        """The (node, input_nr) through which gradient flows into this tensor."""
        if self.grad_fn is not None:
            return self.grad_fn, self._output_nr
        return self._get_grad_accumulator(), 0

    def _get_grad_accumulator(self) -> AccumulateGrad:
        """This leaf's node, exposed (see ``AccumulateGrad``): for edges the user, a root or
        a ``grad()`` input may reach. The leaf holds it weakly, as PyTorch does."""
        acc = self._grad_accumulator
        if type(acc) is not AccumulateGrad:
            with accumulator_lock:
                acc = self._grad_accumulator
                if type(acc) is not AccumulateGrad:
                    found: AccumulateGrad | None = acc() if acc is not None else None
                    if found is None:
                        found = AccumulateGrad(self)
                        self._grad_accumulator = weakref.ref(found)
                    return found
        acc._expose()  # (an owned one: outside the lock, which it takes)
        return acc

    def _owned_grad_accumulator(self) -> AccumulateGrad:
        """This leaf's node for an edge of a ``Function``'s node, which also holds the leaf
        (``function._apply_with_grad``): a CPU leaf's is owned by the leaf and serves every
        forward pass (see ``AccumulateGrad``); the caller has found none owned."""
        ref = self._grad_accumulator
        found = ref() if ref is not None else None  # (an exposed one, alive: no lock)
        if found is not None:
            return found  # type: ignore[no-any-return]
        with accumulator_lock:
            acc = self._grad_accumulator
            if type(acc) is AccumulateGrad:
                return acc
            found = acc() if acc is not None else None
            if found is not None:
                return found  # type: ignore[no-any-return]
            if self.device.backend.has_streams:
                # Its stream is the one current when it is made: one per graph, as before.
                made = AccumulateGrad(self)
                self._grad_accumulator = weakref.ref(made)
            else:
                made = self._grad_accumulator = AccumulateGrad(self, owned=True)
            return made

    def _accumulator(self) -> AccumulateGrad | None:
        """This leaf's node if it has one now (owned, or alive behind the weak reference)."""
        acc = self._grad_accumulator
        if acc is None or type(acc) is AccumulateGrad:
            return acc
        found: AccumulateGrad | None = acc()
        return found

    def detach(self) -> Tensor:
        """A new tensor sharing this tensor's data (and version counter), without history."""
        out = Tensor(self.data, self.device)
        out._version_counter = self._ensure_version_counter()
        return out

    def detach_(self) -> Tensor:
        """Detach this tensor from the graph in place and make it a leaf."""
        if self._base is not None:
            raise RuntimeError(
                "Can't detach views in-place. Use detach() instead: it returns a new tensor."
            )
        self.grad_fn = None
        self._output_nr = 0
        self._requires_grad = False
        return self

    def retain_grad(self) -> None:
        """Keep ``.grad`` for this non-leaf tensor after backward (a no-op on leaves)."""
        if not self._requires_grad:
            raise RuntimeError("can't retain_grad on Tensor that has requires_grad=False")
        if self.grad_fn is None or self._retains_grad:
            return
        self.grad_fn._set_retains_grad(self._output_nr, self)
        self._retains_grad = True

    def register_hook(self, hook: Callable[[Tensor], Tensor | None]) -> RemovableHandle:
        """Register ``hook(grad) -> Tensor | None`` called with this tensor's gradient.

        The hook may return a replacement gradient. Runs on an executor thread during backward.
        As in PyTorch, it is called with ``None`` when the node producing this tensor runs
        but the tensor got no gradient (an unused output of ``unbind``, say); it must then
        return ``None``. Returns a handle whose ``remove()`` unregisters it.
        """
        if not self._requires_grad:
            raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")
        if self.grad_fn is not None:
            return self.grad_fn._register_tensor_pre_hook(self._output_nr, hook)
        if self._backward_hooks is None:
            self._backward_hooks = HookDict(self)
        return RemovableHandle(self._backward_hooks, hook)

    def register_post_accumulate_grad_hook(self, hook: Callable[[Tensor], None]) -> RemovableHandle:
        """Register ``hook(tensor)`` called after gradient is accumulated into ``.grad``.

        Leaf tensors only. The hook returns nothing; it may read or modify ``tensor.grad``.
        """
        if self.grad_fn is not None:
            raise RuntimeError(
                "post accumulate grad hooks cannot be registered on non-leaf tensors"
            )
        if not self._requires_grad:
            raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")
        if self._post_accumulate_grad_hooks is None:
            self._post_accumulate_grad_hooks = HookDict(self)
        return RemovableHandle(self._post_accumulate_grad_hooks, hook)

    def _clear_plain(self) -> None:
        """(``HookDict``'s owner) A hook is being registered on this leaf: its node, if it
        exists, leaves the engine's fast path (a new one reads the leaf's hooks as it is
        made)."""
        acc = self._accumulator()
        if acc is not None:
            acc._plain = 0

    def _refresh_plain(self) -> None:
        """(``HookDict``'s owner) A hook of this leaf was removed: its node may take the
        engine's fast path again."""
        acc = self._accumulator()
        if acc is not None:
            acc._refresh_plain()

    # ------------------------------------------------------------------------- backward
    def backward(
        self,
        gradient: Tensor | None = None,
        retain_graph: builtins.bool | None = None,
        create_graph: builtins.bool = False,
        inputs: Tensor | Sequence[Tensor] | None = None,
    ) -> Coroutine[Any, Any, None]:
        """Accumulate the gradient of this tensor into the ``.grad`` of graph leaves.

        Returns a coroutine: ``await loss.backward()``. Reading ``.grad`` (as
        ``optimizer.step()`` does) after calling it without ``await`` raises an error that
        says so. See :func:`aioautograd.backward`.
        """
        return track(
            _engine_api()._backward(self, gradient, retain_graph, create_graph, inputs),
            "loss.backward()",
        )

    def backward_sync(
        self,
        gradient: Tensor | None = None,
        retain_graph: builtins.bool | None = None,
        create_graph: builtins.bool = False,
        inputs: Tensor | Sequence[Tensor] | None = None,
    ) -> None:
        """Blocking twin of :meth:`backward` for code without a running event loop."""
        _engine_api().backward_sync(self, gradient, retain_graph, create_graph, inputs=inputs)

    # ------------------------------------------------------------------- conversions
    def numpy(self) -> np.ndarray[Any, Any]:
        """The data as a NumPy array (shares memory on CPU)."""
        if self._requires_grad:
            raise RuntimeError(
                "Can't call numpy() on Tensor that requires grad. "
                "Use tensor.detach().numpy() instead."
            )
        if self.device.type != "cpu":
            raise TypeError(
                f"can't convert {self.device} device type tensor to numpy. "
                "Use Tensor.cpu() to copy the tensor to host memory first."
            )
        array: np.ndarray[Any, Any] = self.data
        return array

    def tolist(self) -> Any:
        return self.detach().cpu().data.tolist()

    def item(self) -> Any:
        """The value of a one-element tensor as a Python number."""
        if self.data.size != 1:
            raise RuntimeError(
                f"a Tensor with {self.data.size} elements cannot be converted to Scalar"
            )
        return self.data.item()

    def __float__(self) -> builtins.float:
        return float(self.item())

    def __int__(self) -> builtins.int:
        return int(self.item())

    def __bool__(self) -> builtins.bool:
        if self.data.size != 1:
            raise RuntimeError(
                f"Boolean value of Tensor with {self.data.size} elements is ambiguous"
            )
        return bool(self.data.item())

    def __array__(
        self, dtype: Any = None, copy: builtins.bool | None = None
    ) -> np.ndarray[Any, Any]:
        array = self.numpy()
        return array if dtype is None else array.astype(dtype, copy=False)

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self.data.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> tuple[builtins.int, builtins.int]:
        device: tuple[builtins.int, builtins.int] = self.data.__dlpack_device__()
        return device

    def to(self, *args: Any, **kwargs: Any) -> Tensor:
        """``to(device)``, ``to(dtype)`` or ``to(device, dtype)``: differentiable copy/cast."""
        target_device: Device | None = None
        target_dtype: np.dtype[Any] | None = None
        for value in (*args, kwargs.get("device"), kwargs.get("dtype")):
            if value is None:
                continue
            if is_device_spec(value):
                target_device = _as_device(value)
            else:
                target_dtype = np.dtype(value)
        out = self
        if target_dtype is not None and target_dtype != self.dtype:
            out = unary.cast(out, target_dtype)
        if target_device is not None and target_device is not self.device:
            out = unary.to_device(out, target_device)
        return out

    def cpu(self) -> Tensor:
        return self.to(CPU)

    def cuda(self, index: builtins.int | None = None) -> Tensor:
        return self.to(_as_device("cuda" if index is None else f"cuda:{index}"))

    def type_as(self, other: Tensor) -> Tensor:
        return self.to(other.dtype)

    def float(self) -> Tensor:
        return self.to(np.float32)

    def double(self) -> Tensor:
        return self.to(np.float64)

    def half(self) -> Tensor:
        return self.to(np.float16)

    def long(self) -> Tensor:
        return self.to(np.int64)

    def int(self) -> Tensor:
        return self.to(np.int32)

    def bool(self) -> Tensor:
        return self.to(np.bool_)

    def clone(self) -> Tensor:
        return unary.clone(self)

    def _copy_grad(self) -> Tensor:
        """A copy recorded as ``CopyBackwards`` when this tensor requires grad: how a first
        gradient enters a leaf's ``.grad`` under ``create_graph`` (never aliasing the graph)."""
        return unary.copy_grad(self)

    def contiguous(self) -> Tensor:
        return self

    def __repr__(self) -> str:
        body = np.array2string(
            self.detach().cpu().data, separator=", ", prefix="tensor(", threshold=50
        )
        extras = []
        if self.device.type != "cpu":
            extras.append(f"device='{self.device}'")
        if self.data.dtype not in (np.float32, np.int64, np.bool_):
            extras.append(f"dtype={self.data.dtype}")
        if self.grad_fn is not None:
            extras.append(f"grad_fn=<{self.grad_fn.name()}>")
        elif self._requires_grad:
            extras.append("requires_grad=True")
        return "tensor(" + ", ".join([body, *extras]) + ")"

    def __copy__(self) -> Tensor:
        """``copy.copy``: a tensor with this one's fields (data, ``.grad``, hooks...), as the
        default copy takes them, but without its gradient accumulator: a leaf's is its own
        (this one's may be owned by it and point at it: the copy's gradients would land in
        this tensor's ``.grad``)."""
        out = Tensor.__new__(type(self))
        for name in _COPIED_SLOTS:
            setattr(out, name, getattr(self, name))
        out._grad_accumulator = None
        return out

    def __deepcopy__(self, memo: dict[builtins.int, Any]) -> Tensor:
        # A fresh leaf: copying the slots would share the gradient accumulator and hooks.
        if self.grad_fn is not None:
            raise RuntimeError(
                "Only Tensors created explicitly by the user (graph leaves) support the "
                "deepcopy protocol; deepcopy tensor.detach() instead"
            )
        if id(self) in memo:
            copied: Tensor = memo[id(self)]
            return copied
        result = Tensor(self.data.copy(), self.device, self._requires_grad)
        memo[id(self)] = result
        if self._grad is not None:
            result._grad = Tensor(self._grad.data.copy(), self._grad.device)
        return result

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        """Pickling, as PyTorch's: a leaf with a copy of this tensor's data, its device and
        ``requires_grad`` (a non-leaf comes back as a leaf that requires grad); no history,
        ``.grad`` or hooks (a warning says when hooks are dropped)."""
        if self._backward_hooks or self._post_accumulate_grad_hooks:
            warnings.warn(
                "hooks registered on this tensor will not be pickled; register them again "
                "on the restored tensor",
                UserWarning,
                stacklevel=2,
            )
        state = getattr(self, "__dict__", None)  # a subclass's own attributes
        return _rebuild_tensor, (type(self), self.data, self.device, self.requires_grad, state)

    def __iter__(self) -> Iterator[Tensor]:
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d tensor")
        return (self[i] for i in range(self.shape[0]))

    # ---------------------------------------------------------------------- arithmetic
    # The hottest operators call their Function directly (one Python call fewer per op).
    def __add__(self, other: Any) -> Tensor:
        return arithmetic.Add.apply(self, other)

    def __radd__(self, other: Any) -> Tensor:
        # Commutative: the tensor first, as PyTorch records ``2 + x`` (its edges: x, None).
        return arithmetic.Add.apply(self, other)

    def __sub__(self, other: Any) -> Tensor:
        return arithmetic.sub(self, other)

    def __rsub__(self, other: Any) -> Tensor:
        return arithmetic.sub(other, self)

    def __mul__(self, other: Any) -> Tensor:
        return arithmetic.Mul.apply(self, other)

    def __rmul__(self, other: Any) -> Tensor:
        return arithmetic.Mul.apply(self, other)

    def __truediv__(self, other: Any) -> Tensor:
        return arithmetic.Div.apply(self, other)

    def __rtruediv__(self, other: Any) -> Tensor:
        return arithmetic.Div.apply(other, self)

    def __pow__(self, other: Any) -> Tensor:
        return arithmetic.pow(self, other)

    def __rpow__(self, other: Any) -> Tensor:
        return arithmetic.pow(other, self)

    def __matmul__(self, other: Any) -> Tensor:
        return linalg.matmul(self, other)

    def __rmatmul__(self, other: Any) -> Tensor:
        return linalg.matmul(other, self)

    def __neg__(self) -> Tensor:
        return arithmetic.Neg.apply(self)

    def __pos__(self) -> Tensor:
        return self

    def __abs__(self) -> Tensor:
        return unary.abs(self)

    def __iadd__(self, other: Any) -> Tensor:
        return inplace.add_(self, other)

    def __imul__(self, other: Any) -> Tensor:
        return inplace.mul_(self, other)

    # Comparisons produce boolean tensors that never require grad.
    def _compare(self, other: Any, op: Callable[[Array, Any], Array]) -> Tensor:
        other_data = other.data if isinstance(other, Tensor) else other
        return Tensor(op(self.data, other_data), self.device)

    def __eq__(self, other: Any) -> Tensor:  # type: ignore[override]
        return self._compare(other, self.xp.equal)

    def __ne__(self, other: Any) -> Tensor:  # type: ignore[override]
        return self._compare(other, self.xp.not_equal)

    def __lt__(self, other: Any) -> Tensor:
        return self._compare(other, self.xp.less)

    def __le__(self, other: Any) -> Tensor:
        return self._compare(other, self.xp.less_equal)

    def __gt__(self, other: Any) -> Tensor:
        return self._compare(other, self.xp.greater)

    def __ge__(self, other: Any) -> Tensor:
        return self._compare(other, self.xp.greater_equal)

    def eq(self, other: Any) -> Tensor:
        return self.__eq__(other)

    def __invert__(self) -> Tensor:
        return Tensor(self.xp.logical_not(self.data), self.device)

    def __and__(self, other: Any) -> Tensor:
        return self._compare(other, self.xp.logical_and)

    def __or__(self, other: Any) -> Tensor:
        return self._compare(other, self.xp.logical_or)

    def add(self, other: Any, alpha: builtins.float = 1) -> Tensor:
        return arithmetic.add(self, other if alpha == 1 else other * alpha)

    def sub(self, other: Any, alpha: builtins.float = 1) -> Tensor:
        return arithmetic.sub(self, other if alpha == 1 else other * alpha)

    def mul(self, other: Any) -> Tensor:
        return arithmetic.mul(self, other)

    def div(self, other: Any) -> Tensor:
        return arithmetic.div(self, other)

    def pow(self, exponent: Any) -> Tensor:
        return arithmetic.pow(self, exponent)

    def neg(self) -> Tensor:
        return arithmetic.neg(self)

    def matmul(self, other: Tensor) -> Tensor:
        return linalg.matmul(self, other)

    def maximum(self, other: Any) -> Tensor:
        return arithmetic.maximum(self, other)

    def minimum(self, other: Any) -> Tensor:
        return arithmetic.minimum(self, other)

    # --------------------------------------------------------------------------- unary
    def exp(self) -> Tensor:
        return unary.exp(self)

    def log(self) -> Tensor:
        return unary.log(self)

    def sqrt(self) -> Tensor:
        return unary.sqrt(self)

    def abs(self) -> Tensor:
        return unary.abs(self)

    def sin(self) -> Tensor:
        return unary.sin(self)

    def cos(self) -> Tensor:
        return unary.cos(self)

    def tanh(self) -> Tensor:
        return unary.tanh(self)

    def sigmoid(self) -> Tensor:
        return unary.sigmoid(self)

    def relu(self) -> Tensor:
        return unary.relu(self)

    def clamp(self, min: builtins.float | None = None, max: builtins.float | None = None) -> Tensor:
        return unary.clamp(self, min, max)

    clip = clamp

    # ----------------------------------------------------------------------- reductions
    def sum(
        self,
        dim: builtins.int | Sequence[builtins.int] | None = None,
        keepdim: builtins.bool = False,
    ) -> Tensor:
        return reduction.sum(self, dim, keepdim)

    def sum_to_size(self, *size: Any) -> Tensor:
        """Sum this tensor down to ``size``, to which it must broadcast (PyTorch's
        ``sum_to_size``): how a broadcast gradient is reduced to its input's shape."""
        return reduction.sum_to_size(self, _shape_args(size))

    def mean(
        self,
        dim: builtins.int | Sequence[builtins.int] | None = None,
        keepdim: builtins.bool = False,
    ) -> Tensor:
        return reduction.mean(self, dim, keepdim)

    def max(self, dim: builtins.int | None = None, keepdim: builtins.bool = False) -> Any:
        return reduction.max(self, dim, keepdim)

    def min(self, dim: builtins.int | None = None, keepdim: builtins.bool = False) -> Any:
        return reduction.min(self, dim, keepdim)

    def var(
        self,
        dim: builtins.int | Sequence[builtins.int] | None = None,
        unbiased: builtins.bool | None = None,
        keepdim: builtins.bool = False,
        *,
        correction: builtins.int | None = None,
    ) -> Tensor:
        return reduction.var(self, dim, unbiased, keepdim, correction=correction)

    def std(
        self,
        dim: builtins.int | Sequence[builtins.int] | None = None,
        unbiased: builtins.bool | None = None,
        keepdim: builtins.bool = False,
        *,
        correction: builtins.int | None = None,
    ) -> Tensor:
        return reduction.std(self, dim, unbiased, keepdim, correction=correction)

    def var_mean(
        self,
        dim: builtins.int | Sequence[builtins.int] | None = None,
        unbiased: builtins.bool | None = None,
        keepdim: builtins.bool = False,
        *,
        correction: builtins.int | None = None,
    ) -> tuple[Tensor, Tensor]:
        return reduction.var_mean(self, dim, unbiased, keepdim, correction=correction)

    def all(
        self,
        dim: builtins.int | Sequence[builtins.int] | None = None,
        keepdim: builtins.bool = False,
    ) -> Tensor:
        return reduction.all(self, dim, keepdim)

    def any(
        self,
        dim: builtins.int | Sequence[builtins.int] | None = None,
        keepdim: builtins.bool = False,
    ) -> Tensor:
        return reduction.any(self, dim, keepdim)

    def norm(
        self,
        p: builtins.float | str | None = "fro",
        dim: builtins.int | tuple[builtins.int, ...] | None = None,
        keepdim: builtins.bool = False,
    ) -> Tensor:
        return linalg.norm(self, p, dim, keepdim)

    def cumsum(self, dim: builtins.int) -> Tensor:
        return reduction.cumsum(self, dim)

    def logsumexp(
        self, dim: builtins.int | Sequence[builtins.int], keepdim: builtins.bool = False
    ) -> Tensor:
        return reduction.logsumexp(self, dim, keepdim)

    def softmax(self, dim: builtins.int) -> Tensor:
        return reduction.softmax(self, dim)

    def log_softmax(self, dim: builtins.int) -> Tensor:
        return reduction.log_softmax(self, dim)

    def argmax(self, dim: builtins.int | None = None, keepdim: builtins.bool = False) -> Tensor:
        return reduction.argmax(self, dim, keepdim)

    def argmin(self, dim: builtins.int | None = None, keepdim: builtins.bool = False) -> Tensor:
        return reduction.argmin(self, dim, keepdim)

    # ---------------------------------------------------------------------- shape ops
    def reshape(self, *shape: Any) -> Tensor:
        return shape_ops.reshape(self, _shape_args(shape))

    def view(self, *shape: Any) -> Tensor:
        return shape_ops.view(self, _shape_args(shape))

    def view_as(self, other: Tensor) -> Tensor:
        return shape_ops.view_as(self, other)

    def narrow(self, dim: builtins.int, start: builtins.int, length: builtins.int) -> Tensor:
        return shape_ops.narrow(self, dim, start, length)

    def transpose(self, dim0: builtins.int, dim1: builtins.int) -> Tensor:
        return shape_ops.transpose(self, dim0, dim1)

    def permute(self, *dims: Any) -> Tensor:
        return shape_ops.permute(self, _shape_args(dims))

    def expand(self, *sizes: Any) -> Tensor:
        return shape_ops.expand(self, _shape_args(sizes))

    def expand_as(self, other: Tensor) -> Tensor:
        return shape_ops.expand(self, other.shape)

    def squeeze(self, dim: builtins.int | Sequence[builtins.int] | None = None) -> Tensor:
        return shape_ops.squeeze(self, dim)

    def unsqueeze(self, dim: builtins.int) -> Tensor:
        return shape_ops.unsqueeze(self, dim)

    def flatten(self, start_dim: builtins.int = 0, end_dim: builtins.int = -1) -> Tensor:
        return shape_ops.flatten(self, start_dim, end_dim)

    def split(
        self, split_size_or_sections: builtins.int | Sequence[builtins.int], dim: builtins.int = 0
    ) -> tuple[Tensor, ...]:
        return shape_ops.split(self, split_size_or_sections, dim)

    def chunk(self, chunks: builtins.int, dim: builtins.int = 0) -> tuple[Tensor, ...]:
        return shape_ops.chunk(self, chunks, dim)

    def unbind(self, dim: builtins.int = 0) -> tuple[Tensor, ...]:
        return shape_ops.unbind(self, dim)

    # ----------------------------------------------------------------------- indexing
    def __getitem__(self, index: Any) -> Tensor:
        return indexing.getitem(self, index)

    def __setitem__(self, index: Any, value: Any) -> None:
        indexing.setitem(self, index, value)

    def masked_fill(self, mask: Tensor, value: Any) -> Tensor:
        return arithmetic.masked_fill(self, mask, value)

    def gather(self, dim: builtins.int, index: Tensor) -> Tensor:
        return indexing.gather(self, dim, index)

    def index_select(self, dim: builtins.int, index: Tensor) -> Tensor:
        return indexing.index_select(self, dim, index)

    # ------------------------------------------------------------------------ in-place
    def add_(self, other: Any, alpha: builtins.float = 1) -> Tensor:
        return inplace.add_(self, other, alpha)

    def sub_(self, other: Any, alpha: builtins.float = 1) -> Tensor:
        return inplace.add_(self, other, -alpha)

    def mul_(self, other: Any) -> Tensor:
        return inplace.mul_(self, other)

    def exp_(self) -> Tensor:
        return inplace.exp_(self)

    def relu_(self) -> Tensor:
        return inplace.relu_(self)

    def zero_(self) -> Tensor:
        return inplace.zero_(self)

    def fill_(self, value: Any) -> Tensor:
        return inplace.fill_(self, value)

    def copy_(self, src: Any) -> Tensor:
        return inplace.copy_(self, src)


_ndarray = np.ndarray


# The fields ``Tensor.__copy__`` copies (every one ``__init__`` sets).
_COPIED_SLOTS = tuple(name for name in Tensor.__slots__ if name != "__weakref__")


def _rebuild_tensor(
    cls: type[Tensor], data: Array, device: Device, requires_grad: bool, state: Any
) -> Tensor:
    """(``Tensor.__reduce_ex__``) The unpickled tensor: a fresh leaf of ``cls``."""
    out = Tensor.__new__(cls)
    Tensor.__init__(out, data, device, requires_grad)
    if state:
        out.__dict__.update(state)
    return out


def wrap(result: Any, device: Device) -> Tensor:
    """A tensor holding ``result``; NumPy returns scalars for 0-d results, make them arrays."""
    if type(result) is not _ndarray and device.xp is np:
        result = np.asarray(result)
    return Tensor(result, device)


_api: ModuleType | None = None


def _engine_api() -> ModuleType:
    """``aioautograd.engine.api``, bound on first use: the one place ``Tensor`` reaches the
    engine. The engine imports ``Tensor``; importing it back at module level would put the
    engine in one import cycle with tensor, ops, function and the nodes."""
    global _api
    if _api is None:
        from aioautograd.engine import api

        _api = api
    return _api


def _data_ptr(array: Array) -> builtins.int:
    if isinstance(array, np.ndarray):
        return builtins.int(array.__array_interface__["data"][0])
    return builtins.int(array.data.ptr)  # CuPy: a MemoryPointer


def _shape_args(args: tuple[Any, ...]) -> tuple[int, ...]:
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        return tuple(args[0])
    return tuple(args)


def _check_grad_assignment(tensor: Tensor, grad: Any) -> None:
    if not isinstance(grad, Tensor):
        raise TypeError(f"assigned grad expected to be a Tensor or None, got {type(grad).__name__}")
    if grad is tensor:
        raise RuntimeError(
            "can't assign Variable as its own grad: assign a separate tensor (e.g. "
            "tensor.detach().clone())"
        )
    if grad.shape != tensor.data.shape:
        raise RuntimeError(
            f"assigned grad has data of a different size: {grad.shape} vs {tensor.data.shape}"
        )
    if grad.dtype != tensor.data.dtype:
        raise RuntimeError(
            f"assigned grad has data of a different type: {grad.dtype} vs {tensor.data.dtype}"
        )
    if grad.device is not tensor.device:
        raise RuntimeError(
            f"assigned grad has data located on a different device: {grad.device} vs "
            f"{tensor.device}"
        )


# These modules import Tensor; import them after the class exists (at module level: an
# import statement inside a method costs ~8k instructions per call).
from aioautograd.autograd.hooks import HookDict, RemovableHandle  # noqa: E402
from aioautograd.autograd.node import AccumulateGrad, accumulator_lock  # noqa: E402
from aioautograd.autograd.unawaited import _pending, check_awaited, track  # noqa: E402
from aioautograd.ops import (  # noqa: E402
    arithmetic,
    indexing,
    inplace,
    linalg,
    reduction,
    unary,
)
from aioautograd.ops import shape as shape_ops  # noqa: E402
