"""Shape ops: ``reshape view transpose permute expand squeeze unsqueeze flatten``, and
``cat stack split chunk`` (with ``unbind``, the backward of ``stack``).

Outputs that alias the input's memory are made with ``x._view_of``: they share the base's
version counter, so an in-place change of the base is detected through a saved view. ``split``
and ``unbind`` are single multi-output nodes (as in PyTorch): a piece that receives no
gradient gets zeros in backward, and the gradient of the input is one ``cat`` (or ``stack``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aioautograd._typing import Shape
from aioautograd.ops._util import MultiOutputOp, Op, wrap
from aioautograd.tensor import Tensor


def _dim(dim: int, ndim: int) -> int:
    """``dim`` as a non-negative axis of an ``ndim``-dimensional tensor (0-d acts as 1-d)."""
    span = max(ndim, 1)
    if not -span <= dim < span:
        raise IndexError(
            f"Dimension out of range (expected to be in range of [{-span}, {span - 1}], but "
            f"got {dim})"
        )
    return dim % span


def _infer_shape(shape: Shape, numel: int) -> Shape:
    shape = tuple(int(s) for s in shape)
    if shape.count(-1) > 1:
        raise RuntimeError("only one dimension can be inferred")
    known = 1
    for s in shape:
        if s != -1:
            if s < 0:
                raise RuntimeError(f"invalid shape dimension {s}")
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
        data = x.data.reshape(shape)
        # NumPy copies when the strides do not allow a view; a copy has its own version.
        if x.xp.may_share_memory(data, x.data):
            return x._view_of(data)
        return Tensor(data, x.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return reshape(grad, ctx.shape), None


# The same op under PyTorch's node name for unsqueeze.
Unsqueeze: type[Reshape] = type("Unsqueeze", (Reshape,), {})


class Expand(Op):
    @staticmethod
    def forward(ctx: Any, x: Tensor, shape: Shape) -> Tensor:
        ctx.shape = x.shape
        return x._view_of(x.xp.broadcast_to(x.data, shape))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        from aioautograd.ops.reduction import sum_to_size

        return sum_to_size(grad, ctx.shape), None


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


class Cat(Op):
    @staticmethod
    def forward(ctx: Any, dim: int, *tensors: Tensor) -> Tensor:
        ctx.dim = dim
        ctx.sizes = [t.shape[dim] for t in tensors]
        xp = tensors[0].xp
        return wrap(xp.concatenate([t.data for t in tensors], axis=dim), tensors[0].device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        needs = ctx.needs_input_grad[1:]
        pieces = Split.apply(grad, ctx.sizes, ctx.dim)
        return (None, *(piece if need else None for piece, need in zip(pieces, needs, strict=True)))


class Stack(Op):
    @staticmethod
    def forward(ctx: Any, dim: int, *tensors: Tensor) -> Tensor:
        ctx.dim = dim
        xp = tensors[0].xp
        return wrap(xp.stack([t.data for t in tensors], axis=dim), tensors[0].device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        needs = ctx.needs_input_grad[1:]
        pieces = Unbind.apply(grad, ctx.dim)
        return (None, *(piece if need else None for piece, need in zip(pieces, needs, strict=True)))


class Split(MultiOutputOp):
    """``x`` cut along ``dim`` into consecutive pieces of ``sizes``: views, one output each."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, sizes: Sequence[int], dim: int) -> tuple[Tensor, ...]:
        ctx.dim = dim
        data = x.data
        lead = (slice(None),) * dim
        pieces = []
        start = 0
        for size in sizes:
            pieces.append(x._view_of(data[(*lead, slice(start, start + size))]))
            start += size
        return tuple(pieces)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, None, None]:
        return cat(grads, ctx.dim), None, None


class SplitWithSizes(Split):
    """``split`` with a list of sizes (a separate class for PyTorch's node name)."""


class Unbind(MultiOutputOp):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int) -> tuple[Tensor, ...]:
        ctx.dim = dim
        data = x.data
        lead = (slice(None),) * dim
        # The trailing Ellipsis keeps 0-d results arrays (views), not NumPy scalars.
        return tuple(x._view_of(data[(*lead, i, Ellipsis)]) for i in range(data.shape[dim]))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, None]:
        return stack(grads, ctx.dim), None


def reshape(x: Tensor, shape: Shape) -> Tensor:
    """``x`` with a new shape (one ``-1`` is inferred).

    Returns a view sharing ``x``'s memory (and version counter) when the strides allow it,
    else a copy.
    """
    target = _infer_shape(shape, x.numel())
    if target == x.shape:
        return x
    return Reshape.apply(x, target)


def view(x: Tensor, shape: Shape) -> Tensor:
    """Like :func:`reshape` (NumPy decides whether a copy is needed), but always a new
    tensor: ``x.view(x.shape)`` is a view of ``x``, not ``x`` itself, as in PyTorch."""
    return Reshape.apply(x, _infer_shape(shape, x.numel()))


def view_as(x: Tensor, other: Tensor) -> Tensor:
    """``x.view(other.shape)``."""
    return view(x, other.shape)


def narrow(x: Tensor, dim: int, start: int, length: int) -> Tensor:
    """The view ``x[..., start:start + length, ...]`` along ``dim`` (``start`` may be
    negative, counted from the end).

    Raises:
        IndexError: for a ``dim`` or ``start`` out of range.
        RuntimeError: for a negative ``length`` or a slice past the end.
    """
    if x.ndim == 0:
        raise RuntimeError("narrow() cannot be applied to a 0-dim tensor.")
    d = _dim(dim, x.ndim)
    size = x.shape[d]
    if not -size <= start <= size:
        raise IndexError(
            f"start out of range (expected to be in range of [{-size}, {size}], but got {start})"
        )
    if start < 0:
        start += size
    if length < 0:
        raise RuntimeError("narrow(): length must be non-negative.")
    if start + length > size:
        raise RuntimeError(f"start ({start}) + length ({length}) exceeds dimension size ({size}).")
    return x[(slice(None),) * d + (slice(start, start + length),)]


def expand(x: Tensor, shape: Shape) -> Tensor:
    """Broadcast ``x`` to ``shape`` without copying (a read-only view).

    ``-1`` keeps the size of an existing dimension; new dimensions are added at the front.

    Raises:
        RuntimeError: if ``shape`` has fewer dimensions than ``x`` or a non-singleton
            dimension of ``x`` would change size.
    """
    shape = tuple(int(s) for s in shape)
    lead = len(shape) - x.ndim
    if lead < 0:
        raise RuntimeError(
            f"expand: the number of sizes provided ({len(shape)}) must be greater or equal "
            f"to the number of dimensions in the tensor ({x.ndim})"
        )
    target = []
    for i, size in enumerate(shape):
        if i < lead:
            if size < 0:
                raise RuntimeError(
                    f"The expanded size of the tensor ({size}) isn't allowed in a leading, "
                    f"non-existing dimension {i}"
                )
            target.append(size)
            continue
        existing = x.shape[i - lead]
        if size == -1:
            size = existing
        elif existing != 1 and size != existing:
            raise RuntimeError(
                f"The expanded size of the tensor ({size}) must match the existing size "
                f"({existing}) at non-singleton dimension {i}.  Target sizes: {list(shape)}.  "
                f"Tensor sizes: {list(x.shape)}"
            )
        target.append(size)
    if tuple(target) == x.shape:
        return x
    return Expand.apply(x, tuple(target))


def permute(x: Tensor, dims: Sequence[int]) -> Tensor:
    """Reorder the dimensions of ``x`` (a view); ``dims`` may be negative."""
    ndim = x.ndim
    normalized = tuple(_dim(d, ndim) for d in dims)
    if len(normalized) != ndim or sorted(normalized) != list(range(ndim)):
        raise RuntimeError(
            f"permute(): dims {list(dims)} is not a permutation of the {ndim} dimensions"
        )
    if normalized == tuple(range(ndim)):
        return x
    return Permute.apply(x, normalized)


def transpose(x: Tensor, dim0: int, dim1: int) -> Tensor:
    """Swap dimensions ``dim0`` and ``dim1`` (a view)."""
    ndim = x.ndim
    a, b = _dim(dim0, ndim), _dim(dim1, ndim)
    if ndim < 2:
        return x
    dims = list(range(ndim))
    dims[a], dims[b] = dims[b], dims[a]
    return permute(x, dims)


def squeeze(x: Tensor, dim: int | Sequence[int] | None = None) -> Tensor:
    """Remove dimensions of size 1: all of them, or those among ``dim`` (an int or a
    sequence of ints) that have size 1. Other dimensions named in ``dim`` are left alone."""
    if dim is None:
        shape = tuple(s for s in x.shape if s != 1)
    else:
        dims = {_dim(d, x.ndim) for d in ((dim,) if isinstance(dim, int) else dim)}
        shape = tuple(s for i, s in enumerate(x.shape) if not (i in dims and s == 1))
    return reshape(x, shape)


def unsqueeze(x: Tensor, dim: int) -> Tensor:
    """Insert a dimension of size 1 at ``dim`` (``-1`` appends one)."""
    d = _dim(dim, x.ndim + 1)
    return Unsqueeze.apply(x, (*x.shape[:d], 1, *x.shape[d:]))


def flatten(x: Tensor, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    """Merge dimensions ``start_dim`` to ``end_dim`` (inclusive) into one.

    A 0-d tensor becomes shape ``(1,)``. Returns a view when the strides allow it.

    Raises:
        RuntimeError: if ``start_dim`` comes after ``end_dim``.
    """
    if x.ndim == 0:
        _dim(start_dim, 0)
        _dim(end_dim, 0)
        return reshape(x, (1,))
    start, end = _dim(start_dim, x.ndim), _dim(end_dim, x.ndim)
    if start > end:
        raise RuntimeError("flatten() has invalid args: start_dim cannot come after end_dim")
    merged = 1
    for s in x.shape[start : end + 1]:
        merged *= s
    return reshape(x, (*x.shape[:start], merged, *x.shape[end + 1 :]))


def _check_same_device(tensors: Sequence[Any], name: str) -> None:
    if not tensors:
        raise ValueError(f"{name}(): expected a non-empty list of Tensors")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TypeError(
                f"{name}(): expected a sequence of Tensors, but element {i} is {type(t).__name__}"
            )
        if t.device is not first.device:
            raise RuntimeError(
                "Expected all tensors to be on the same device, but found at least two "
                f"devices, {first.device} and {t.device}!"
            )


def cat(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Concatenate ``tensors`` along the existing dimension ``dim``.

    All tensors need the same number of dimensions (at least one) and equal sizes outside
    ``dim``; dtypes are promoted as NumPy does.

    Raises:
        ValueError: for an empty sequence.
        RuntimeError: for 0-d tensors, mismatched shapes or devices.
    """
    tensors = tuple(tensors)
    _check_same_device(tensors, "cat")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.ndim == 0:
            raise RuntimeError(f"zero-dimensional tensor (at position {i}) cannot be concatenated")
    d = _dim(dim, first.ndim)
    for i, t in enumerate(tensors):
        if t.ndim != first.ndim:
            raise RuntimeError(
                f"Tensors must have same number of dimensions: got {first.ndim} and {t.ndim}"
            )
        for axis in range(t.ndim):
            if axis != d and t.shape[axis] != first.shape[axis]:
                raise RuntimeError(
                    f"Sizes of tensors must match except in dimension {d}. Expected size "
                    f"{first.shape[axis]} but got size {t.shape[axis]} for tensor number {i} "
                    "in the list."
                )
    return Cat.apply(d, *tensors)


def stack(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Stack equally shaped ``tensors`` along a new dimension ``dim``.

    Raises:
        ValueError: for an empty sequence.
        RuntimeError: for mismatched shapes or devices.
    """
    tensors = tuple(tensors)
    _check_same_device(tensors, "stack")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.shape != first.shape:
            raise RuntimeError(
                f"stack expects each tensor to be equal size, but got {list(first.shape)} at "
                f"entry 0 and {list(t.shape)} at entry {i}"
            )
    d = _dim(dim, first.ndim + 1)
    return Stack.apply(d, *tensors)


def unbind(x: Tensor, dim: int = 0) -> tuple[Tensor, ...]:
    """The slices of ``x`` along ``dim``, with that dimension removed (views)."""
    if x.ndim == 0:
        raise IndexError("Dimension specified as 0 but tensor has no dimensions")
    return Unbind.apply(x, _dim(dim, x.ndim))


def split(
    x: Tensor, split_size_or_sections: int | Sequence[int], dim: int = 0
) -> tuple[Tensor, ...]:
    """Split ``x`` along ``dim`` into views.

    An int is the size of every piece (the last one may be smaller); a sequence gives the
    size of each piece and must sum to ``x.shape[dim]``. Each piece is differentiable; pieces
    that receive no gradient contribute zeros.

    Raises:
        RuntimeError: for sizes that do not fit ``x.shape[dim]``.
    """
    if x.ndim == 0:
        raise RuntimeError("split expects at least a 1-dimensional tensor")
    d = _dim(dim, x.ndim)
    length = x.shape[d]
    if isinstance(split_size_or_sections, int):
        size = split_size_or_sections
        if size < 0:
            raise RuntimeError(f"split expects split_size be non-negative, but got {size}")
        if size == 0:
            if length != 0:
                raise RuntimeError(
                    "split_size can only be 0 if dimension size is 0, but got dimension size "
                    f"of {length}"
                )
            return Split.apply(x, [0], d)
        count = max(-(-length // size), 1)
        sizes = [size] * (count - 1) + [length - size * (count - 1)]
        return Split.apply(x, sizes, d)
    sizes = [int(s) for s in split_size_or_sections]
    if any(s < 0 for s in sizes) or sum(sizes) != length:
        raise RuntimeError(
            f"split_with_sizes expects split_sizes to sum exactly to {length} (input tensor's "
            f"size at dimension {d}), but got split_sizes={sizes}"
        )
    return SplitWithSizes.apply(x, sizes, d)


def chunk(x: Tensor, chunks: int, dim: int = 0) -> tuple[Tensor, ...]:
    """Split ``x`` into at most ``chunks`` views of ``ceil(size / chunks)`` along ``dim``.

    As in PyTorch, fewer chunks come back when the size does not allow ``chunks`` of them
    (``chunk(arange(6), 4)`` gives three pieces of 2).

    Raises:
        RuntimeError: if ``chunks`` is not positive.
    """
    if chunks <= 0:
        raise RuntimeError(f"chunk expects `chunks` to be greater than 0, got: {chunks}")
    if x.ndim == 0:
        raise RuntimeError("chunk expects at least a 1-dimensional tensor")
    d = _dim(dim, x.ndim)
    length = x.shape[d]
    if length == 0:
        return Split.apply(x, [0] * chunks, d)
    return split(x, -(-length // chunks), d)
