"""PyTorch as an oracle for the op tests: run one function on both libraries and compare."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import aioautograd as ag
from tests.helpers import assert_close


async def check_against_torch(
    torch: Any,
    fn: Callable[..., Any],
    *arrays: np.ndarray[Any, Any],
    requires_grad: tuple[bool, ...] | None = None,
) -> None:
    """Assert that ``fn(ag, *tensors)`` and ``fn(torch, *tensors)`` agree in values and in the
    gradients of a random weighted sum of their outputs (``fn`` may return a tuple).

    ``requires_grad`` says which inputs are differentiated (default: all); the others must get
    no gradient from either library.
    """
    flags = requires_grad or (True,) * len(arrays)
    ours = [ag.tensor(a, requires_grad=f) for a, f in zip(arrays, flags, strict=True)]
    theirs = [torch.tensor(a, requires_grad=f) for a, f in zip(arrays, flags, strict=True)]
    out, torch_out = fn(ag, *ours), fn(torch, *theirs)
    outs = out if isinstance(out, tuple) else (out,)
    torch_outs = torch_out if isinstance(torch_out, tuple) else (torch_out,)
    assert len(outs) == len(torch_outs)
    rng = np.random.default_rng(7)
    loss = torch_loss = None
    for o, t in zip(outs, torch_outs, strict=True):
        assert tuple(o.shape) == tuple(t.shape)
        assert_close(o, t)
        weight = rng.standard_normal(tuple(o.shape))
        term = (o * weight).sum()
        torch_term = (t * torch.from_numpy(weight)).sum()
        loss = term if loss is None else loss + term
        torch_loss = torch_term if torch_loss is None else torch_loss + torch_term
    assert loss is not None
    assert torch_loss is not None
    await loss.backward()
    torch_loss.backward()
    for x, t in zip(ours, theirs, strict=True):
        if t.grad is None:
            assert x.grad is None
        else:
            assert x.grad is not None
            assert_close(x.grad, t.grad)
