"""`gradcheck`: compare analytical gradients (the engine's) with central finite differences."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from aioautograd.engine.api import grad as autograd_grad
from aioautograd.grad_mode import no_grad
from aioautograd.tensor import Tensor


class GradcheckError(RuntimeError):
    """Raised by :func:`gradcheck` when analytical and numerical Jacobians differ."""


def _outputs(fn: Callable[..., Any], inputs: Sequence[Any]) -> tuple[Tensor, ...]:
    out = fn(*inputs)
    return out if isinstance(out, tuple) else (out,)


def _numerical_jacobian(
    fn: Callable[..., Any], inputs: Sequence[Any], index: int, eps: float
) -> list[np.ndarray[Any, Any]]:
    """Per output, a (numel(output), numel(input)) matrix of central differences."""
    target: Tensor = inputs[index]
    flat = target.data.reshape(-1)  # a view: perturb the input in place
    with no_grad():
        outs = _outputs(fn, inputs)
        columns: list[list[np.ndarray[Any, Any]]] = [[] for _ in outs]
        for k in range(flat.size):
            original = flat[k].item()
            flat[k] = original + eps
            plus = [o.detach().cpu().data.astype(np.float64).ravel() for o in _outputs(fn, inputs)]
            flat[k] = original - eps
            minus = [o.detach().cpu().data.astype(np.float64).ravel() for o in _outputs(fn, inputs)]
            flat[k] = original
            for j in range(len(outs)):
                columns[j].append((plus[j] - minus[j]) / (2 * eps))
    return [
        np.stack(cols, axis=1) if cols else np.zeros((o.numel(), 0))
        for cols, o in zip(columns, outs, strict=True)
    ]


async def _analytical_jacobian(
    fn: Callable[..., Any], inputs: Sequence[Any], diff_indices: list[int]
) -> list[list[np.ndarray[Any, Any]]]:
    """``[input][output]`` matrices of shape (numel(output), numel(input)) from ``grad()``."""
    outs = _outputs(fn, inputs)
    targets = [inputs[i] for i in diff_indices]
    result = [[np.zeros((o.numel(), t.numel())) for o in outs] for t in targets]
    for j, out in enumerate(outs):
        if not out.requires_grad:
            continue
        for row in range(out.numel()):
            seed = np.zeros(out.numel(), dtype=out.dtype)
            seed[row] = 1
            grad_output = Tensor(out.xp.asarray(seed.reshape(out.shape)), out.device)
            grads = await autograd_grad(
                out, targets, grad_output, retain_graph=True, allow_unused=True
            )
            for i, g in enumerate(grads):
                if g is not None:
                    result[i][j][row] = g.detach().cpu().data.astype(np.float64).ravel()
    return result


async def gradcheck(
    fn: Callable[..., Any],
    inputs: Sequence[Any] | Tensor,
    *,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    raise_exception: bool = True,
) -> bool:
    """Check the gradients of ``fn`` at ``inputs`` against central finite differences.

    Differentiates with respect to every input tensor with ``requires_grad=True``; use
    float64 inputs. A coroutine (it runs backward passes): ``assert await gradcheck(f, (x,))``.

    Raises:
        GradcheckError: on a mismatch, naming the input and output (unless
            ``raise_exception=False``, which returns ``False`` instead).
    """
    args = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    diff = [i for i, a in enumerate(args) if isinstance(a, Tensor) and a.requires_grad]
    if not diff:
        raise ValueError("gradcheck expects at least one input tensor with requires_grad=True")
    for i in diff:
        if args[i].dtype != np.float64:
            raise ValueError(
                f"gradcheck input {i} has dtype {args[i].dtype}; use float64 for finite "
                "differences to be meaningful"
            )
    analytical = await _analytical_jacobian(fn, args, diff)
    for position, i in enumerate(diff):
        numerical = _numerical_jacobian(fn, args, i, eps)
        for j, (num, ana) in enumerate(zip(numerical, analytical[position], strict=True)):
            if not np.allclose(ana, num, atol=atol, rtol=rtol):
                if not raise_exception:
                    return False
                raise GradcheckError(
                    f"Jacobian mismatch for output {j} with respect to input {i},\n"
                    f"numerical:{num}\nanalytical:{ana}"
                )
    return True
