"""`Linear`: ``y = x @ weight.T + bias``."""

from __future__ import annotations

import math

from aioautograd._typing import DeviceLike, DTypeLike
from aioautograd.nn import functional as F
from aioautograd.nn import init
from aioautograd.nn.layers._factory import new_parameter
from aioautograd.nn.module import Module
from aioautograd.nn.parameter import Parameter
from aioautograd.tensor import Tensor


class Linear(Module):
    """Applies ``y = x @ weight.T + bias`` to inputs of shape ``(*, in_features)``.

    ``weight`` is ``(out_features, in_features)``; weight and bias are initialised as in
    PyTorch, from ``U(-1/sqrt(in_features), 1/sqrt(in_features))`` (Kaiming uniform with
    ``a=sqrt(5)``).

    Example:
        >>> layer = nn.Linear(20, 30)
        >>> layer(ag.randn(128, 20)).shape
        (128, 30)
    """

    weight: Parameter
    bias: Parameter | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: DeviceLike = None,
        dtype: DTypeLike = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = new_parameter((out_features, in_features), device, dtype)
        if bias:
            self.bias = new_parameter((out_features,), device, dtype)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-draw weight and bias from the default initialisation."""
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
            init.uniform_(self.bias, -bound, bound)

    def forward(self, input: Tensor) -> Tensor:
        return F.linear(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )
