"""`validate_outputs`: check the gradients a node returned against its consumers' metadata.

This is the one place broadcasting is undone: a gradient whose shape broadcasts to the
expected shape is summed down to it (tinygrad's central reduction), so binary ops return
gradients at the broadcast shape and never repeat an ``unbroadcast`` of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from aioautograd.autograd.node import AccumulateGrad
from aioautograd.grad_mode import _grad_enabled_get
from aioautograd.tensor import Tensor, wrap

if TYPE_CHECKING:
    from aioautograd._typing import Shape
    from aioautograd.autograd.node import Edge, Node
    from aioautograd.devices.device import Device


def is_expandable_to(shape: Shape, desired: Shape) -> bool:
    """Whether ``shape`` broadcasts to ``desired`` (so ``desired`` can be summed to ``shape``)."""
    ndim = len(shape)
    target_ndim = len(desired)
    if ndim > target_ndim:
        return False
    if desired[target_ndim - ndim :] == shape:  # leading dimensions only (a bias gradient)
        return True
    for i in range(1, ndim + 1):
        size = shape[-i]
        if size != 1 and size != desired[-i]:
            return False
    return True


def validate_outputs(
    edges: Sequence[Edge], grads: Sequence[Tensor | None], producer: Node | str
) -> list[Tensor | None]:
    """Return ``grads`` checked against the input metadata of the nodes they flow into.

    Shapes that broadcast to the expected shape are reduced with ``sum_to_size``; floating
    dtypes are cast; anything else raises ``RuntimeError`` naming the node (``producer``, or
    what to call it) and the index.
    """
    return list(validated(edges, grads, producer))


def validated(
    edges: Sequence[Edge], grads: Sequence[Tensor | None], producer: Node | str
) -> Sequence[Tensor | None]:
    """`validate_outputs` without the copy: ``grads`` itself when every gradient conforms
    already (the engine's per-node case), else a list with the conformed ones."""
    if len(grads) != len(edges):
        raise RuntimeError(
            f"invalid number of gradients returned by {_name(producer)} - expected "
            f"{len(edges)}, but got {len(grads)}"
        )
    result: list[Tensor | None] | None = None
    i = 0  # a counter, not enumerate(): this runs for every node of every backward
    for next_node, input_nr in edges:
        grad = grads[i]
        if next_node is not None and grad is not None:
            checked = conformed(i, grad, next_node, input_nr, producer)
            if checked is not grad:
                if result is None:
                    result = list(grads)
                result[i] = checked
        i += 1  # noqa: SIM113
    return grads if result is None else result


def conformed(i: int, grad: Any, next_node: Node, input_nr: int, producer: Node | str) -> Tensor:
    """Gradient ``i`` of ``producer`` checked against input ``input_nr`` of ``next_node``:
    ``grad`` itself when it has the expected shape, dtype and device (the engine's per-edge
    case), else conformed by ``_conform`` (or the error saying why it cannot be)."""
    if type(next_node) is AccumulateGrad:
        # Its metadata, read live from the leaf without building the property's list (a
        # fan's branches all feed one leaf).
        variable = next_node._ref()
        leaf = variable.data
        shape, dtype, device = leaf.shape, leaf.dtype, variable.device
    else:
        shape, dtype, device = next_node._input_metadata[input_nr]
    # (dtypes of NumPy results are usually the same object)
    if type(grad) is Tensor and (
        grad.device is device
        and (data := grad.data).shape == shape
        and (data.dtype is dtype or data.dtype == dtype)
    ):
        return grad
    return _conform(i, grad, shape, dtype, device, producer)


def _conform(
    i: int, grad: Any, shape: Shape, dtype: Any, device: Device, producer: Node | str
) -> Tensor:
    """``grad`` summed to ``shape`` and cast to ``dtype``, or the error saying why not."""
    if type(grad) is Tensor and grad.device is device:
        # A plain backward's bias gradient first: leading dimensions to sum, dtype and
        # device already right (what the general path below does, without its checks).
        data = grad.data
        lead = data.ndim - len(shape)
        if (
            lead > 0
            and (data.dtype is dtype or data.dtype == dtype)
            and data.shape[lead:] == shape
            and not _grad_enabled_get()
        ):
            summed = device.backend.sum_to_size(data, shape)
            # (a sum to a shape of one or more dimensions is an array: no ``wrap``)
            return Tensor(summed, device) if shape else wrap(summed, device)
    if not isinstance(grad, Tensor):
        raise TypeError(
            f"Function {_name(producer)} returned an invalid gradient at index {i} - expected "
            f"a Tensor or None, got {type(grad).__name__}"
        )
    data = grad.data
    if data.shape != shape:
        if not is_expandable_to(shape, data.shape):
            raise RuntimeError(
                f"Function {_name(producer)} returned an invalid gradient at index {i} - got "
                f"{list(data.shape)} but expected shape compatible with {list(shape)}"
            )
        if _grad_enabled_get():
            grad = grad.sum_to_size(shape)  # recorded (create_graph)
        else:  # a plain backward's bias gradient: the reduction alone
            grad = wrap(grad.device.backend.sum_to_size(data, shape), grad.device)
    if grad.device is not device:
        raise RuntimeError(
            f"Function {_name(producer)} returned an invalid gradient at index {i} - expected "
            f"device {device} but got {grad.device}"
        )
    if grad.data.dtype is not dtype and grad.data.dtype != dtype:
        if dtype.kind not in "fc":
            raise RuntimeError(
                f"Function {_name(producer)} returned a gradient at index {i} for a tensor "
                f"of dtype {dtype}, which cannot have gradients: only floating point tensors "
                "can. Was the .data of a tensor that requires grad replaced by a "
                "non-floating array? Keep it floating point (or detach the tensor)."
            )
        if grad.data.dtype.kind not in "fc":
            raise RuntimeError(
                f"Function {_name(producer)} returned an invalid gradient at index {i} - "
                f"expected a floating point gradient of dtype {dtype} but got "
                f"{grad.data.dtype}"
            )
        grad = grad.to(dtype)
    conformed: Tensor = grad
    return conformed


def _name(producer: Node | str) -> str:
    return producer if isinstance(producer, str) else producer.name()
