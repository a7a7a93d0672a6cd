"""Activation modules: `ReLU`, `GELU`."""

from __future__ import annotations

from aioautograd.nn import functional as F
from aioautograd.nn.module import Module
from aioautograd.tensor import Tensor


class ReLU(Module):
    """Elementwise ``max(x, 0)``; ``inplace=True`` overwrites the input (``relu_``)."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace

    def forward(self, input: Tensor) -> Tensor:
        return F.relu(input, inplace=self.inplace)

    def extra_repr(self) -> str:
        return "inplace=True" if self.inplace else ""


class GELU(Module):
    """Gaussian error linear unit ``x * Phi(x)``; ``approximate="tanh"`` for the tanh form.

    Raises:
        ValueError: if ``approximate`` is not ``"none"`` or ``"tanh"``.
    """

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(
                f"approximate argument must be either none or tanh, got {approximate!r}"
            )
        self.approximate = approximate

    def forward(self, input: Tensor) -> Tensor:
        return F.gelu(input, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
