"""`Conv2d`: 2-D convolution over ``(N, C, H, W)`` inputs."""

from __future__ import annotations

import math
from collections.abc import Sequence

from aioautograd._typing import DeviceLike, DTypeLike
from aioautograd.nn import functional as F
from aioautograd.nn import init
from aioautograd.nn.layers._factory import new_parameter, ntuple
from aioautograd.nn.module import Module
from aioautograd.nn.parameter import Parameter
from aioautograd.tensor import Tensor


class Conv2d(Module):
    """2-D cross-correlation with ``weight`` ``(out_channels, in_channels / groups, kh, kw)``.

    ``padding`` is an int, a pair, ``"valid"`` or ``"same"``; only ``padding_mode="zeros"``
    is supported. Weight and bias are initialised as in PyTorch, from
    ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` with ``fan_in = in_channels / groups * kh * kw``.

    Raises:
        ValueError: if ``groups`` does not divide both channel counts, on an unknown padding
            string, ``"same"`` padding with a stride, or an unsupported ``padding_mode``.
    """

    weight: Parameter
    bias: Parameter | None

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int],
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int] | str = 0,
        dilation: int | Sequence[int] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device: DeviceLike = None,
        dtype: DTypeLike = None,
    ) -> None:
        super().__init__()
        if groups <= 0:
            raise ValueError("groups must be a positive integer")
        if in_channels % groups:
            raise ValueError("in_channels must be divisible by groups")
        if out_channels % groups:
            raise ValueError("out_channels must be divisible by groups")
        if padding_mode != "zeros":
            raise ValueError(
                f"padding_mode {padding_mode!r} is not supported: only 'zeros' is implemented"
            )
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = ntuple(kernel_size, "kernel_size")
        self.stride = ntuple(stride, "stride")
        self.dilation = ntuple(dilation, "dilation")
        if isinstance(padding, str):
            if padding not in ("valid", "same"):
                raise ValueError(
                    f"Invalid padding string {padding!r}, should be one of 'valid', 'same'"
                )
            if padding == "same" and self.stride != (1, 1):
                raise ValueError("padding='same' is not supported for strided convolutions")
            self.padding: tuple[int, int] | str = padding
        else:
            self.padding = ntuple(padding, "padding")
        self.groups = groups
        self.padding_mode = padding_mode
        shape = (out_channels, in_channels // groups, *self.kernel_size)
        self.weight = new_parameter(shape, device, dtype)
        if bias:
            self.bias = new_parameter((out_channels,), device, dtype)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-draw weight and bias from the default initialisation."""
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = self.weight.shape[1] * math.prod(self.kernel_size)
            if fan_in:
                bound = 1 / math.sqrt(fan_in)
                init.uniform_(self.bias, -bound, bound)

    def forward(self, input: Tensor) -> Tensor:
        return F.conv2d(
            input, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups
        )

    def extra_repr(self) -> str:
        text = (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}"
        )
        if self.padding != (0, 0):
            padding = repr(self.padding) if isinstance(self.padding, str) else self.padding
            text += f", padding={padding}"
        if self.dilation != (1, 1):
            text += f", dilation={self.dilation}"
        if self.groups != 1:
            text += f", groups={self.groups}"
        if self.bias is None:
            text += ", bias=False"
        return text
