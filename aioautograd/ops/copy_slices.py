"""In-place ops on views: PyTorch's ``CopySlices`` and the rebased view's ``AsStridedBackward0``.

When an in-place op ``fn`` modifies a view ``v`` of ``base`` while recording, the change is
a change of ``base``: ``base.grad_fn`` becomes ``CopySlices(fn)``, whose backward takes the
gradient of the new base, runs ``fn``'s backward on the part under the view and sends the
rest to the old base's history unchanged. ``v.grad_fn`` becomes ``AsStridedBackward0``: the
view, re-read from the new base.

The geometry of a view is kept as the flat (C-order) positions in ``base`` of the view's
elements, computed once from the arrays' addresses and strides, here, on the rare in-place
path: views themselves carry nothing extra, so the forward of view ops costs no more.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from aioautograd._typing import Array
from aioautograd.autograd.node import Edge, Grads, Node
from aioautograd.ops.arithmetic import masked_fill
from aioautograd.ops.indexing import Index, IndexPut
from aioautograd.tensor import Tensor, _data_ptr


def _byte_offsets(xp: Any, shape: tuple[int, ...], strides: tuple[int, ...], start: int) -> Array:
    """The byte offset of every element of an array of ``shape`` and ``strides``."""
    out = xp.full(shape, start, dtype=np.int64)
    ndim = len(shape)
    for axis, (size, stride) in enumerate(zip(shape, strides, strict=True)):
        steps = [1] * ndim
        steps[axis] = size
        out = out + (xp.arange(size, dtype=np.int64) * stride).reshape(steps)
    return out


def view_positions(base: Array, view: Array, xp: Any) -> Array:
    """For each element of ``view`` (an array aliasing ``base``'s memory), its flat C-order
    position in ``base``: an int64 array of ``view``'s shape."""
    itemsize = base.itemsize
    offsets = _byte_offsets(xp, view.shape, view.strides, _data_ptr(view) - _data_ptr(base))
    if base.flags.c_contiguous:
        return offsets // itemsize
    # Any layout: match the view's offsets against the base's, sorted.
    base_offsets = _byte_offsets(xp, base.shape, base.strides, 0).ravel()
    order = xp.argsort(base_offsets)
    found = xp.searchsorted(base_offsets[order], offsets)
    return order[xp.minimum(found, base_offsets.size - 1)]


class CopySlices(Node):
    """The ``grad_fn`` of a base modified in place through one of its views."""

    __slots__ = ("base_shape", "fn", "fn_output_nr", "positions", "view_input_nr")

    def __init__(
        self,
        base_edge: Edge,
        base: Tensor,
        positions: Array,
        fn: Node,
        view_input_nr: int,
        fn_output_nr: int,
    ) -> None:
        others = tuple(e for i, e in enumerate(fn.next_functions) if i != view_input_nr)
        super().__init__((base_edge, *others))
        self._add_input_metadata(base)
        self._stream = fn._stream
        self._refresh_plain()
        self.base_shape = base.shape
        self.positions = positions
        self.fn = fn
        self.view_input_nr = view_input_nr
        self.fn_output_nr = fn_output_nr

    def name(self) -> str:
        return "CopySlices"

    def apply(self, grads: Grads) -> Sequence[Tensor | None]:
        grad = grads[0]
        if grad is None:
            return [None] * len(self._next_edges)
        flat = grad.reshape(-1)
        fn_grads: Grads = [None] * self.fn.num_inputs
        fn_grads[self.fn_output_nr] = Index.apply(flat, self.positions)
        results = list(self.fn.apply(fn_grads))
        view_grad = results.pop(self.view_input_nr)
        mask = Tensor(grad.xp.zeros(flat.shape, dtype=bool), grad.device)
        mask.data[self.positions] = True
        base_grad = masked_fill(flat, mask, 0.0)
        if view_grad is not None:
            base_grad = base_grad + IndexPut.apply(view_grad, flat.shape, self.positions)
        return [base_grad.reshape(self.base_shape), *results]

    def release_variables(self) -> None:
        self.fn.release_variables()


class AsStridedBackward0(Node):
    """The ``grad_fn`` of a view after an in-place op on it: the view re-read from the
    (rebased) base."""

    __slots__ = ("base_numel", "base_shape", "positions")
    inline = True

    def __init__(self, base: Tensor, view: Tensor, positions: Array) -> None:
        assert base.grad_fn is not None
        super().__init__(((base.grad_fn, base._output_nr),))
        self._add_input_metadata(view)
        self.base_shape = base.shape
        self.base_numel = base.numel()
        self.positions = positions

    def apply(self, grads: Grads) -> Sequence[Tensor | None]:
        grad = grads[0]
        if grad is None:
            return [None]
        flat = IndexPut.apply(grad, (self.base_numel,), self.positions)
        return [flat.reshape(self.base_shape)]


def rebase_view(view: Tensor, fn: Node, view_input_nr: int) -> None:
    """Record the in-place op ``fn`` (whose output ``view`` is its input ``view_input_nr``)
    on ``view``'s base, as PyTorch does: see the module docstring."""
    if fn.is_async:
        raise RuntimeError(
            f"{fn.name()} modified a view in place and has an async backward: CopySlices "
            "runs it synchronously; clone() the view before the in-place op"
        )
    base = view._base
    assert base is not None
    positions = view_positions(base.data, view.data, base.xp)
    base_edge: Edge = base._gradient_edge() if base._requires_grad else (None, 0)
    base.grad_fn = CopySlices(base_edge, base, positions, fn, view_input_nr, view._output_nr)
    base._output_nr = 0
    base._requires_grad = True
    view.grad_fn = AsStridedBackward0(base, view, positions)
    view._output_nr = 0
