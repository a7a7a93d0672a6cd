"""Indexing: ``__getitem__`` (basic and advanced), ``gather``, ``index_select``."""

from __future__ import annotations

from typing import Any

from aioautograd.ops._util import Op
from aioautograd.tensor import Tensor


def _index_data(index: Any) -> Any:
    """Replace tensors inside an index expression by their arrays."""
    if isinstance(index, Tensor):
        return index.data
    if isinstance(index, tuple):
        return tuple(_index_data(i) for i in index)
    if isinstance(index, list):
        return [_index_data(i) for i in index]
    return index


def _is_basic(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(
        i is None or i is Ellipsis or isinstance(i, (int, slice)) and not isinstance(i, bool)
        for i in items
    )


class GetItem(Op):
    @staticmethod
    def forward(ctx: Any, x: Tensor, index: Any) -> Tensor:
        ctx.shape, ctx.dtype, ctx.index = x.shape, x.dtype, index
        data = x.data[index]
        if _is_basic(index):
            return x._view_of(data)
        return Tensor(data, x.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return IndexBackward.apply(grad, ctx.shape, ctx.index), None


class IndexBackward(Op):
    """Scatter-add ``grad`` into zeros of ``shape`` at ``index`` (repeated indices add up)."""

    @staticmethod
    def forward(ctx: Any, grad: Tensor, shape: tuple[int, ...], index: Any) -> Tensor:
        ctx.index = index
        xp = grad.xp
        out = xp.zeros(shape, dtype=grad.dtype)
        if _is_basic(index):
            out[index] = grad.data
        else:
            xp.add.at(out, index, grad.data)
        return Tensor(out, grad.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return GetItem.apply(grad, ctx.index), None, None


def getitem(x: Tensor, index: Any) -> Tensor:
    """``x[index]`` with NumPy semantics; basic indexing returns a view."""
    return GetItem.apply(x, _index_data(index))  # type: ignore[no-any-return]
