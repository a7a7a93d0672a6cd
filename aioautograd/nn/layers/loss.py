"""Loss modules: `CrossEntropyLoss`, `MSELoss` (wrappers of the functional forms)."""

from __future__ import annotations

from aioautograd.nn import functional as F
from aioautograd.nn.module import Module
from aioautograd.tensor import Tensor


class CrossEntropyLoss(Module):
    """``F.cross_entropy(input, target, weight, ...)`` as a module.

    ``weight`` (per-class, shape ``(C,)``) is registered as a buffer.
    """

    weight: Tensor | None

    def __init__(
        self,
        weight: Tensor | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(
            input,
            target,
            self.weight,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
        )


class MSELoss(Module):
    """``F.mse_loss(input, target, reduction=...)`` as a module."""

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.reduction = reduction

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(input, target, reduction=self.reduction)
