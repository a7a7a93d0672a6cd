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


def _differentiable_inputs(
    inputs: Sequence[Any] | Tensor, name: str
) -> tuple[tuple[Any, ...], list[int]]:
    """The argument tuple and the positions of the float64 tensors that require grad."""
    args = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    diff = [i for i, a in enumerate(args) if isinstance(a, Tensor) and a.requires_grad]
    if not diff:
        raise ValueError(f"{name} expects at least one input tensor with requires_grad=True")
    for i in diff:
        if args[i].dtype != np.float64:
            raise ValueError(
                f"{name} input {i} has dtype {args[i].dtype}; use float64 for finite "
                "differences to be meaningful"
            )
    return args, diff


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
    args, diff = _differentiable_inputs(inputs, "gradcheck")
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


async def _first_grads(
    fn: Callable[..., Any],
    args: Sequence[Any],
    diff: list[int],
    seeds: list[np.ndarray[Any, Any]],
    create_graph: bool,
) -> list[Tensor]:
    outs = _outputs(fn, args)
    pairs = [(o, s) for o, s in zip(outs, seeds, strict=True) if o.requires_grad]
    roots = [o for o, _ in pairs]
    grad_outputs = [Tensor(o.xp.asarray(s), o.device) for o, s in pairs]
    targets = [args[i] for i in diff]
    grads = await autograd_grad(
        roots,
        targets,
        grad_outputs,
        create_graph=create_graph,
        allow_unused=True,
        materialize_grads=True,
    )
    return [g for g in grads if g is not None]


async def gradgradcheck(
    fn: Callable[..., Any],
    inputs: Sequence[Any] | Tensor,
    *,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    raise_exception: bool = True,
) -> bool:
    """Check second derivatives: the gradients of ``fn``'s vector-Jacobian product (computed
    with ``create_graph=True``) against finite differences of that product.

    Use float64 inputs; a coroutine like :func:`gradcheck`.
    """
    args, diff = _differentiable_inputs(inputs, "gradgradcheck")
    rng = np.random.default_rng(1234)
    with no_grad():
        seeds = [rng.standard_normal(o.shape).astype(o.dtype) for o in _outputs(fn, args)]

    first = await _first_grads(fn, args, diff, seeds, create_graph=True)
    targets = [args[i] for i in diff]
    for position, i in enumerate(diff):
        target = args[i]
        flat = target.data.reshape(-1)
        for j, g in enumerate(first):
            analytical = np.zeros((g.numel(), target.numel()))
            if g.requires_grad:
                for row in range(g.numel()):
                    seed = np.zeros(g.numel(), dtype=g.dtype)
                    seed[row] = 1
                    (second,) = await autograd_grad(
                        g,
                        [targets[position]],
                        Tensor(g.xp.asarray(seed.reshape(g.shape)), g.device),
                        retain_graph=True,
                        allow_unused=True,
                    )
                    if second is not None:
                        analytical[row] = second.detach().cpu().data.astype(np.float64).ravel()
            numerical = np.zeros_like(analytical)
            for k in range(flat.size):
                original = flat[k].item()
                flat[k] = original + eps
                plus = await _first_grads(fn, args, diff, seeds, create_graph=False)
                flat[k] = original - eps
                minus = await _first_grads(fn, args, diff, seeds, create_graph=False)
                flat[k] = original
                numerical[:, k] = (
                    plus[j].detach().cpu().data.astype(np.float64).ravel()
                    - minus[j].detach().cpu().data.astype(np.float64).ravel()
                ) / (2 * eps)
            if not np.allclose(analytical, numerical, atol=atol, rtol=rtol):
                if not raise_exception:
                    return False
                raise GradcheckError(
                    f"second-derivative mismatch for gradient {j} with respect to input {i},\n"
                    f"numerical:{numerical}\nanalytical:{analytical}"
                )
    return True
