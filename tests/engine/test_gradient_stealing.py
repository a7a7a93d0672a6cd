"""AccumulateGrad keeps ("steals") a gradient nobody else references, as PyTorch does.

``autograd/node.py`` decides with ``sys.getrefcount``: the expected counts depend on how
the running CPython counts references (3.12 made some objects immortal, 3.14 borrows
references on the stack). These tests pin both sides on the running version: a fresh
gradient becomes ``.grad`` without a copy, and one that someone else still holds is copied.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import numpy as np
import pytest

import aioautograd as ag

_VERSION = ".".join(map(str, sys.version_info[:3]))


def _function(inline: bool, keep: list[Any] | None) -> type[ag.Function]:
    class Produce(ag.Function):
        _inline_backward = inline  # True: a node the engine may run on the awaiting thread
        made: weakref.ref[Any] | None = None

        @staticmethod
        def forward(ctx: Any, x: ag.Tensor) -> ag.Tensor:
            return x.detach() * 1.0

        @staticmethod
        def backward(ctx: Any, grad: ag.Tensor) -> ag.Tensor:
            out = ag.tensor(np.full(grad.shape, 3.0))
            Produce.made = weakref.ref(out.data)  # a weak reference counts for nothing
            if keep is not None:
                keep.append(out)  # someone else holds the gradient: it must be copied
            return out

    return Produce


@pytest.mark.timeout(10)
@pytest.mark.parametrize("inline", [False, True], ids=["executor", "inline"])
async def test_an_exclusively_owned_gradient_is_kept_without_a_copy(inline: bool) -> None:
    produce = _function(inline, keep=None)
    x = ag.tensor(np.zeros(4), requires_grad=True)
    await produce.apply(x).backward(ag.ones(4, dtype="float64"))
    assert x.grad is not None
    np.testing.assert_array_equal(x.grad.numpy(), np.full(4, 3.0))
    assert produce.made is not None
    assert x.grad.data is produce.made(), f"the gradient was copied on Python {_VERSION}"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("inline", [False, True], ids=["executor", "inline"])
async def test_a_gradient_held_elsewhere_is_copied(inline: bool) -> None:
    kept: list[Any] = []
    produce = _function(inline, keep=kept)
    x = ag.tensor(np.zeros(4), requires_grad=True)
    await produce.apply(x).backward(ag.ones(4, dtype="float64"))
    assert x.grad is not None
    assert x.grad.data is not kept[0].data, f"a shared gradient was stolen on Python {_VERSION}"
    kept[0].data[...] = -1.0  # the holder's writes do not reach .grad
    np.testing.assert_array_equal(x.grad.numpy(), np.full(4, 3.0))
