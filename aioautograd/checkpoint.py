"""`checkpoint`: trade compute for memory by recomputing a segment during backward.

Built on reentrant backward, as PyTorch's ``use_reentrant=True`` checkpoint: the forward
runs without recording, and the node's backward (on an executor thread) recomputes the
segment with grad enabled and runs a nested ``backward_sync`` through it, served on the
same thread.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from aioautograd import factories
from aioautograd.engine.api import backward_sync
from aioautograd.engine.graph_task import current_graph_task
from aioautograd.function import Function
from aioautograd.grad_mode import enable_grad, is_grad_enabled, no_grad
from aioautograd.tensor import Tensor


class CheckpointFunction(Function):
    @staticmethod
    def forward(
        ctx: Any, run_function: Callable[..., Any], preserve_rng_state: bool, *args: Any
    ) -> Any:
        ctx.run_function = run_function
        ctx.rng_state = factories.generator().bit_generator.state if preserve_rng_state else None
        ctx.inputs = [None if isinstance(a, Tensor) else a for a in args]
        ctx.tensor_indices = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
        ctx.save_for_backward(*(a for a in args if isinstance(a, Tensor)))
        with no_grad():
            return run_function(*args)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor) -> tuple[Tensor | None, ...]:
        graph_task = current_graph_task.get()
        if graph_task is not None and graph_task.exec_info is not None:
            # The nested backward accumulates into .grad of whatever the segment uses: it
            # cannot deliver gradients to grad() or restrict them to backward(inputs=...).
            raise RuntimeError(
                "checkpoint is incompatible with grad() and with passing `inputs` to "
                "backward(): its backward recomputes the segment and runs a nested backward "
                "into .grad. Call .backward() without `inputs` instead."
            )
        inputs = list(ctx.inputs)
        detached: list[Tensor] = []
        for index, saved in zip(ctx.tensor_indices, ctx.saved_tensors, strict=True):
            copy = saved.detach()
            copy.requires_grad = saved.requires_grad
            inputs[index] = copy
            detached.append(copy)
        rng = factories.generator()
        current_state = rng.bit_generator.state
        if ctx.rng_state is not None:
            rng.bit_generator.state = ctx.rng_state
        try:
            with enable_grad():
                outputs = ctx.run_function(*inputs)
        finally:
            if ctx.rng_state is not None:
                rng.bit_generator.state = current_state
        if isinstance(outputs, Tensor):
            outputs = (outputs,)
        pairs = [
            (out, grad)
            for out, grad in zip(outputs, grad_outputs, strict=False)
            if isinstance(out, Tensor) and out.requires_grad
        ]
        if not pairs:
            raise RuntimeError(
                "none of the checkpointed outputs require grad: checkpoint needs at least one "
                "input (or parameter used inside the function) with requires_grad=True"
            )
        backward_sync([out for out, _ in pairs], [grad for _, grad in pairs])
        grads: list[Tensor | None] = [None, None, *(None for _ in inputs)]
        for index, tensor in zip(ctx.tensor_indices, detached, strict=True):
            grads[2 + index] = tensor.grad
        return tuple(grads)


def checkpoint(function: Callable[..., Any], *args: Any, preserve_rng_state: bool = True) -> Any:
    """Run ``function(*args)`` without storing its intermediate tensors; recompute them
    during backward.

    Parameters used inside ``function`` (closures, module weights) receive their gradients
    in ``.grad`` during the recomputation. Random ops (dropout) see the same random numbers
    in the recomputation when ``preserve_rng_state`` is true.

    Example::

        h = aioautograd.checkpoint(block, x)   # block's activations are not kept
        await h.sum().backward()
    """
    if is_grad_enabled() and not any(isinstance(a, Tensor) and a.requires_grad for a in args):
        warnings.warn(
            "None of the inputs have requires_grad=True. Gradients will be None: checkpoint "
            "records its node only when an input tensor requires grad (pass the activations "
            "that lead into the segment).",
            UserWarning,
            stacklevel=2,
        )
    return CheckpointFunction.apply(function, preserve_rng_state, *args)
