"""``Im2Col`` / ``Col2Im``: the two linear ops ``conv2d`` runs on, each the other's backward
(the convolution itself is one batched matmul per group over the columns)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aioautograd.ops._util import Op
from aioautograd.tensor import Tensor


@dataclass(frozen=True)
class ConvGeometry:
    """Where the windows of a 2-D convolution lie in its (N, C, H, W) input."""

    input_shape: tuple[int, int, int, int]
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[tuple[int, int], tuple[int, int]]  # (top, bottom), (left, right)
    dilation: tuple[int, int]
    output: tuple[int, int]

    def padded_shape(self) -> tuple[int, int, int, int]:
        n, c, h, w = self.input_shape
        (top, bottom), (left, right) = self.padding
        return n, c, h + top + bottom, w + left + right

    def window(self, i: int, j: int) -> tuple[slice, slice]:
        """The rows and columns of the padded input that kernel tap ``(i, j)`` reads."""
        row = i * self.dilation[0]
        col = j * self.dilation[1]
        (out_h, out_w), (stride_h, stride_w) = self.output, self.stride
        return (
            slice(row, row + stride_h * (out_h - 1) + 1, stride_h),
            slice(col, col + stride_w * (out_w - 1) + 1, stride_w),
        )


class Im2Col(Op):
    """``(N, C, H, W)`` -> ``(C, kh, kw, N, OH, OW)``: every kernel tap's view of the input.

    Channels lead so that ``reshape(groups, C/groups * kh * kw, N * OH * OW)`` is free and
    the convolution is one matrix product per group (batch folded into the columns).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, geometry: ConvGeometry) -> Tensor:
        ctx.geometry = geometry
        xp, data = x.xp, x.data
        (top, bottom), (left, right) = geometry.padding
        if top or bottom or left or right:
            data = xp.pad(data, ((0, 0), (0, 0), (top, bottom), (left, right)))
        n, c = geometry.input_shape[:2]
        (kh, kw), (out_h, out_w) = geometry.kernel, geometry.output
        cols = xp.empty((c, kh, kw, n, out_h, out_w), dtype=data.dtype)
        for i in range(kh):
            for j in range(kw):
                rows, columns = geometry.window(i, j)
                cols[:, i, j] = data[:, :, rows, columns].transpose(1, 0, 2, 3)
        return Tensor(cols, x.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return Col2Im.apply(grad, ctx.geometry), None


class Col2Im(Op):
    """The adjoint of :class:`Im2Col`: add every tap's columns back onto the input grid."""

    @staticmethod
    def forward(ctx: Any, cols: Tensor, geometry: ConvGeometry) -> Tensor:
        ctx.geometry = geometry
        xp, data = cols.xp, cols.data
        out = xp.zeros(geometry.padded_shape(), dtype=data.dtype)
        kh, kw = geometry.kernel
        for i in range(kh):
            for j in range(kw):
                rows, columns = geometry.window(i, j)
                # Within one tap the strided positions are distinct, so += is a scatter-add.
                out[:, :, rows, columns] += data[:, i, j].transpose(1, 0, 2, 3)
        (top, bottom), (left, right) = geometry.padding
        if top or bottom or left or right:
            height, width = geometry.input_shape[2:]
            out = xp.ascontiguousarray(out[:, :, top : top + height, left : left + width])
        return Tensor(out, cols.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return Im2Col.apply(grad, ctx.geometry), None
