"""Shape ops (views share their base's version counter): ``reshape view transpose permute
expand squeeze unsqueeze flatten``, and ``cat stack split chunk``."""

from __future__ import annotations

from typing import Any

from aioautograd._typing import Shape
from aioautograd.ops._util import Op
from aioautograd.tensor import Tensor


def _infer_shape(shape: Shape, numel: int) -> Shape:
    shape = tuple(int(s) for s in shape)
    if shape.count(-1) > 1:
        raise RuntimeError("only one dimension can be inferred")
    known = 1
    for s in shape:
        if s != -1:
            known *= s
    if -1 in shape:
        if known == 0 or numel % known:
            raise RuntimeError(f"shape '{list(shape)}' is invalid for input of size {numel}")
        shape = tuple(numel // known if s == -1 else s for s in shape)
    elif known != numel:
        raise RuntimeError(f"shape '{list(shape)}' is invalid for input of size {numel}")
    return shape


class Reshape(Op):
    @staticmethod
    def forward(ctx: Any, x: Tensor, shape: Shape) -> Tensor:
        ctx.shape = x.shape
        return x._view_of(x.data.reshape(shape))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad.reshape(ctx.shape), None


class Expand(Op):
    @staticmethod
    def forward(ctx: Any, x: Tensor, shape: Shape) -> Tensor:
        ctx.shape = x.shape
        return x._view_of(x.xp.broadcast_to(x.data, shape))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        from aioautograd.ops.reduction import sum_to_size

        return sum_to_size(grad, ctx.shape), None


def reshape(x: Tensor, shape: Shape) -> Tensor:
    """``x`` with a new shape (one ``-1`` is inferred). Returns a view when possible."""
    target = _infer_shape(shape, x.numel())
    if target == x.shape:
        return x
    return Reshape.apply(x, target)  # type: ignore[no-any-return]


def view(x: Tensor, shape: Shape) -> Tensor:
    """Like :func:`reshape` (NumPy decides whether a copy is needed)."""
    return reshape(x, shape)


def expand(x: Tensor, shape: Shape) -> Tensor:
    """Broadcast ``x`` to ``shape`` without copying (``-1`` keeps a dimension)."""
    shape = tuple(shape)
    lead = len(shape) - x.ndim
    if lead < 0:
        raise RuntimeError(
            f"expand: the number of sizes provided ({len(shape)}) must be greater or equal "
            f"to the number of dimensions in the tensor ({x.ndim})"
        )
    target = tuple(x.shape[i - lead] if s == -1 else s for i, s in enumerate(shape))
    if target == x.shape:
        return x
    return Expand.apply(x, target)  # type: ignore[no-any-return]


def _dim(dim: int, ndim: int) -> int:
    span = max(ndim, 1)
    if not -span <= dim < span:
        raise IndexError(
            f"Dimension out of range (expected to be in range of [{-span}, {span - 1}], but "
            f"got {dim})"
        )
    return dim % span


class Permute(Op):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dims: tuple[int, ...]) -> Tensor:
        ctx.dims = dims
        return x._view_of(x.data.transpose(dims))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        inverse = [0] * len(ctx.dims)
        for i, d in enumerate(ctx.dims):
            inverse[d] = i
        return permute(grad, tuple(inverse)), None


def permute(x: Tensor, dims: tuple[int, ...]) -> Tensor:
    """Reorder dimensions (a view)."""
    ndim = x.ndim
    normalized = tuple(_dim(d, ndim) for d in dims)
    if len(normalized) != ndim or sorted(normalized) != list(range(ndim)):
        raise RuntimeError(
            f"permute(): dims {list(dims)} is not a permutation of the {ndim} dimensions"
        )
    if normalized == tuple(range(ndim)):
        return x
    return Permute.apply(x, normalized)  # type: ignore[no-any-return]


def transpose(x: Tensor, dim0: int, dim1: int) -> Tensor:
    """Swap two dimensions (a view)."""
    ndim = x.ndim
    if ndim < 2 and dim0 in (0, -1) and dim1 in (0, -1):
        return x
    dims = list(range(ndim))
    a, b = _dim(dim0, ndim), _dim(dim1, ndim)
    dims[a], dims[b] = dims[b], dims[a]
    return permute(x, tuple(dims))


def squeeze(x: Tensor, dim: int | None = None) -> Tensor:
    """Remove dimensions of size 1 (only ``dim`` if given and of size 1)."""
    if dim is None:
        shape = tuple(s for s in x.shape if s != 1)
    else:
        d = _dim(dim, x.ndim)
        if x.ndim == 0 or x.shape[d] != 1:
            return x
        shape = x.shape[:d] + x.shape[d + 1 :]
    return reshape(x, shape)


def unsqueeze(x: Tensor, dim: int) -> Tensor:
    """Insert a dimension of size 1 at ``dim``."""
    d = _dim(dim, x.ndim + 1)
    return reshape(x, x.shape[:d] + (1,) + x.shape[d:])
