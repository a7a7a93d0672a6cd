"""`Dropout`: random zeroing while training, identity in evaluation mode."""

from __future__ import annotations

from aioautograd.nn import functional as F
from aioautograd.nn.module import Module
from aioautograd.tensor import Tensor


class Dropout(Module):
    """While ``self.training``, zero each element with probability ``p`` and scale the rest
    by ``1 / (1 - p)``; after ``eval()`` return the input unchanged.

    Masks come from the generator seeded by ``aioautograd.manual_seed``.

    Raises:
        ValueError: if ``p`` is not in ``[0, 1]``.
    """

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p = p

    def forward(self, input: Tensor) -> Tensor:
        return F.dropout(input, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
