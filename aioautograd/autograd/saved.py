"""`SavedTensor`: a tensor stashed for backward, with PyTorch's version check.

A tensor that is an *output* of the node saving it is stored without its ``grad_fn``
(the node itself): keeping it would make a reference cycle node -> saved -> tensor -> node,
freed only by the garbage collector. Unpacking rebuilds a tensor whose ``grad_fn`` is the
node, so double backward through saved outputs works.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from aioautograd.tensor import Tensor, VersionCounter

if TYPE_CHECKING:
    from aioautograd.autograd.node import Node

_SECOND_BACKWARD = (
    "Trying to backward through the graph a second time (or directly access saved tensors "
    "after they have already been freed). Saved intermediate values of the graph are freed "
    "when you call .backward() or autograd.grad(). Specify retain_graph=True if you need to "
    "backward through the graph a second time or if you need to access saved tensors after "
    "calling backward."
)


PackHook = Callable[[Tensor], Any]
UnpackHook = Callable[[Any], Tensor]

# The (pack, unpack) pairs of the enclosing ``graph.saved_tensors_hooks`` blocks, innermost
# last: a ContextVar, so each asyncio task sees only its own.
saved_tensors_hooks_stack: ContextVar[tuple[tuple[PackHook, UnpackHook], ...]] = ContextVar(
    "saved_tensors_hooks", default=()
)


def describe(tensor: Tensor) -> str:
    """``[aioautograd.float32 tensor of shape (3, 4) on cpu]``, as used in error messages."""
    return f"[aioautograd.{tensor.dtype} tensor of shape {tuple(tensor.shape)} on {tensor.device}]"


class SavedTensor:
    __slots__ = ("_counter", "_is_output", "_output_nr", "_saved_version", "_tensor")

    def __init__(self, tensor: Tensor, is_output: bool) -> None:
        counter = tensor._version_counter
        if counter is None:
            counter = tensor._version_counter = VersionCounter()
        self._counter = counter
        self._saved_version = counter.value
        self._is_output = is_output
        self._output_nr = tensor._output_nr
        if is_output:
            # Keep a grad_fn-free alias: same data, same version counter.
            alias = Tensor(tensor.data, tensor.device)
            alias._version_counter = counter
            alias._requires_grad = tensor._requires_grad
            self._tensor = alias
        else:
            self._tensor = tensor

    def unpack(self, node: Node) -> Tensor:
        if self._counter.value != self._saved_version:
            raise RuntimeError(self._modified_message(node))
        if not self._is_output or not self._tensor._requires_grad:
            return self._tensor
        out = Tensor(self._tensor.data, self._tensor.device, True)
        out._version_counter = self._counter
        out.grad_fn = node
        out._output_nr = self._output_nr
        return out

    def _modified_message(self, node: Node) -> str:
        tensor = self._tensor
        if self._is_output:
            origin = f", which is output {self._output_nr} of {node.name()},"
        elif tensor.grad_fn is not None:
            origin = f", which is output {tensor._output_nr} of {tensor.grad_fn.name()},"
        else:
            origin = ""
        return (
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: {describe(tensor)}{origin} is at version {self._counter.value}; "
            f"expected version {self._saved_version} instead. Hint: enable anomaly detection "
            "to find the operation that failed to compute its gradient, with "
            "aioautograd.detect_anomaly(), or clone() the tensor before modifying it in place."
        )


class HookedSavedTensor(SavedTensor):
    """A saved tensor stored as whatever the pack hook returned; unpacked by the unpack hook.

    Keeps the version counter (not the tensor), so an in-place change of the original is
    still reported. A saved output is passed to ``pack`` without its ``grad_fn`` (as
    :class:`SavedTensor` keeps it), and unpacking attaches the node again.
    """

    __slots__ = ("_device", "_packed", "_requires_grad", "_unpack_hook")

    def __init__(self, tensor: Tensor, is_output: bool, pack: PackHook, unpack: UnpackHook) -> None:
        super().__init__(tensor, is_output)
        self._packed = pack(self._tensor)
        self._unpack_hook = unpack
        self._requires_grad = tensor._requires_grad
        self._device = tensor.device
        self._tensor = None  # type: ignore[assignment]  # held by the pack hook, if at all

    def unpack(self, node: Node) -> Tensor:
        if self._counter.value != self._saved_version:
            raise RuntimeError(self._modified_message(node))
        tensor = self._unpack_hook(self._packed)
        if not isinstance(tensor, Tensor):
            raise TypeError(
                "Output of saved tensor unpack_hook expected to be a Tensor but got result of "
                f"type {type(tensor).__name__}; the unpack hook must return a Tensor"
            )
        if not self._is_output or not self._requires_grad:
            return tensor
        out = Tensor(tensor.data, tensor.device, True)
        out._version_counter = self._counter
        out.grad_fn = node
        out._output_nr = self._output_nr
        return out

    def _modified_message(self, node: Node) -> str:
        return (
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: a tensor saved through saved_tensors_hooks on {self._device} "
            f"is at version {self._counter.value}; expected version {self._saved_version} "
            "instead. Hint: clone() the tensor before modifying it in place."
        )


def second_backward_error() -> RuntimeError:
    return RuntimeError(_SECOND_BACKWARD)
