"""`SavedTensor`: a tensor stashed for backward, with PyTorch's version check.

A tensor that is an *output* of the node saving it is stored without its ``grad_fn``
(the node itself): keeping it would make a reference cycle node -> saved -> tensor -> node,
freed only by the garbage collector. Unpacking rebuilds a tensor whose ``grad_fn`` is the
node, so double backward through saved outputs works.
"""

from __future__ import annotations

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


def unpack_arrays(saved: tuple[SavedTensor | None, ...], node: Node) -> tuple[Any, ...]:
    """The arrays of ``saved`` (``None`` stays ``None``), each version-checked."""
    arrays: list[Any] = []
    for entry in saved:
        if entry is None:
            arrays.append(None)
        elif entry._counter.value != entry._saved_version:
            raise RuntimeError(entry._modified_message(node))
        else:
            arrays.append(entry._tensor.data)
    return tuple(arrays)


def second_backward_error() -> RuntimeError:
    return RuntimeError(_SECOND_BACKWARD)
