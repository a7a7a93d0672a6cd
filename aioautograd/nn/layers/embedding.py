"""`Embedding`: a lookup table of learnable vectors."""

from __future__ import annotations

from aioautograd._typing import DeviceLike, DTypeLike
from aioautograd.grad_mode import no_grad
from aioautograd.nn import functional as F
from aioautograd.nn import init
from aioautograd.nn.layers._factory import new_parameter
from aioautograd.nn.module import Module
from aioautograd.nn.parameter import Parameter
from aioautograd.tensor import Tensor


class Embedding(Module):
    """Maps integer indices of any shape to rows of ``weight`` ``(num_embeddings,
    embedding_dim)``, initialised from ``N(0, 1)``.

    The ``padding_idx`` row starts at zero and receives no gradient.

    Raises:
        ValueError: if ``padding_idx`` is out of range.
    """

    weight: Parameter

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        device: DeviceLike = None,
        dtype: DTypeLike = None,
    ) -> None:
        super().__init__()
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError("Padding_idx must be within num_embeddings")
            padding_idx %= num_embeddings
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.weight = new_parameter((num_embeddings, embedding_dim), device, dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-draw the weight from ``N(0, 1)`` and zero the padding row."""
        init.normal_(self.weight)
        if self.padding_idx is not None:
            with no_grad():
                self.weight[self.padding_idx].zero_()

    @classmethod
    def from_pretrained(
        cls, embeddings: Tensor, freeze: bool = True, padding_idx: int | None = None
    ) -> Embedding:
        """An embedding whose weight is a copy of the 2-D ``embeddings`` (frozen by default).

        Raises:
            ValueError: if ``embeddings`` is not 2-D.
        """
        if embeddings.ndim != 2:
            raise ValueError("Embeddings parameter is expected to be 2-dimensional")
        rows, cols = embeddings.shape
        module = cls(rows, cols, padding_idx, device=embeddings.device, dtype=embeddings.dtype)
        with no_grad():
            module.weight.copy_(embeddings.detach())
        module.weight.requires_grad_(not freeze)
        return module

    def forward(self, input: Tensor) -> Tensor:
        return F.embedding(input, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        text = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            text += f", padding_idx={self.padding_idx}"
        return text
