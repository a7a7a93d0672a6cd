"""`LayerNorm`: normalisation over the trailing dimensions."""

from __future__ import annotations

from collections.abc import Sequence

from aioautograd._typing import DeviceLike, DTypeLike
from aioautograd.nn import functional as F
from aioautograd.nn import init
from aioautograd.nn.layers._factory import new_parameter
from aioautograd.nn.module import Module
from aioautograd.nn.parameter import Parameter
from aioautograd.tensor import Tensor


class LayerNorm(Module):
    """Normalise over the last ``len(normalized_shape)`` dimensions (biased variance plus
    ``eps``), then scale by ``weight`` (ones) and shift by ``bias`` (zeros) when
    ``elementwise_affine``.
    """

    weight: Parameter | None
    bias: Parameter | None

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: DeviceLike = None,
        dtype: DTypeLike = None,
    ) -> None:
        super().__init__()
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(int(n) for n in normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = new_parameter(self.normalized_shape, device, dtype)
            if bias:
                self.bias = new_parameter(self.normalized_shape, device, dtype)
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Weight to ones, bias to zeros."""
        if self.weight is not None:
            init.ones_(self.weight)
        if self.bias is not None:
            init.zeros_(self.bias)

    def forward(self, input: Tensor) -> Tensor:
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, "
            f"elementwise_affine={self.elementwise_affine}, bias={self.bias is not None}"
        )
