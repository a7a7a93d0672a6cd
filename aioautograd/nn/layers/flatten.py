"""`Flatten`: fold a range of dimensions into one (e.g. between a conv and a linear layer)."""

from __future__ import annotations

from aioautograd.nn.module import Module
from aioautograd.tensor import Tensor


class Flatten(Module):
    """Flattens dimensions ``start_dim`` to ``end_dim`` (by default all but the batch)."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        super().__init__()
        self.start_dim = start_dim
        self.end_dim = end_dim

    def forward(self, input: Tensor) -> Tensor:
        return input.flatten(self.start_dim, self.end_dim)

    def extra_repr(self) -> str:
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"
