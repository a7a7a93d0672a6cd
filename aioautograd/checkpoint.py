"""`checkpoint`: trade compute for memory by recomputing a segment during backward.

Two flavours, as in PyTorch:

- ``use_reentrant=True`` (the default, as PyTorch's): the forward runs without recording,
  and one node's backward (on an executor thread) recomputes the segment with grad enabled
  and runs a nested ``backward_sync`` through it, served on the same thread.
- ``use_reentrant=False``: the forward records the segment's graph as usual, but under
  ``saved_tensors_hooks`` whose pack hook keeps only a position, not the tensor. The first
  unpack during backward reruns the segment (with the same random numbers) under hooks
  that collect what it saves, and each node gets the tensor at its position. No nested
  backward, so it composes with ``grad(..., inputs=...)``, hooks, keyword arguments and
  double backward (the rerun records on the original inputs).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

from aioautograd import factories
from aioautograd.autograd.saved import saved_tensors_hooks_stack
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


class _Recomputation:
    """One non-reentrant checkpointed call: how to run it again, and what it saves then.

    ``pack`` and ``unpack`` are the saved-tensor hooks of the original forward: a saved
    tensor becomes its position in saving order; the first ``unpack`` (on an executor
    thread, under a lock: several nodes may unpack at once) reruns the segment.
    """

    def __init__(
        self,
        function: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        preserve_rng_state: bool,
    ) -> None:
        self.function = function
        self.args = args
        self.kwargs = kwargs
        self.rng_state = factories.generator().bit_generator.state if preserve_rng_state else None
        self.expected: list[tuple[tuple[int, ...], Any]] = []
        self.recomputed: list[Tensor] | None = None
        self.lock = threading.Lock()

    def pack(self, tensor: Tensor) -> int:
        self.expected.append((tensor.shape, tensor.dtype))
        return len(self.expected) - 1

    def unpack(self, position: int) -> Tensor:
        with self.lock:
            if self.recomputed is None:
                self.recomputed = self._recompute()
        return self.recomputed[position]

    def _recompute(self) -> list[Tensor]:
        collected: list[Tensor] = []

        def collect(tensor: Tensor) -> int:
            collected.append(tensor)
            return len(collected) - 1

        rng = factories.generator()
        current_state = rng.bit_generator.state
        if self.rng_state is not None:
            rng.bit_generator.state = self.rng_state
        token = saved_tensors_hooks_stack.set(((collect, collected.__getitem__),))
        try:
            with enable_grad():
                # On the original inputs: the recomputed tensors hang off their history, so
                # a create_graph backward differentiates through them (double backward).
                self.function(*self.args, **self.kwargs)
        finally:
            saved_tensors_hooks_stack.reset(token)
            if self.rng_state is not None:
                rng.bit_generator.state = current_state
        found = [(t.shape, t.dtype) for t in collected]
        if found != self.expected:
            raise RuntimeError(
                "checkpoint recomputation mismatch: the checkpointed "
                f"function saved {len(self.expected)} tensors in forward "
                f"({self.expected[:4]}...) but {len(found)} when recomputed ({found[:4]}...). "
                "The function must do the same operations each time it runs (same control "
                "flow, shapes and requires_grad); pass preserve_rng_state=True for random ops."
            )
        return collected


def _checkpoint_without_reentrant(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    preserve_rng_state: bool,
) -> Any:
    frame = _Recomputation(function, args, kwargs, preserve_rng_state)
    token = saved_tensors_hooks_stack.set(
        (*saved_tensors_hooks_stack.get(), (frame.pack, frame.unpack))
    )
    try:
        return function(*args, **kwargs)
    finally:
        saved_tensors_hooks_stack.reset(token)


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    **kwargs: Any,
) -> Any:
    """Run ``function(*args, **kwargs)`` without storing its intermediate tensors;
    recompute them during backward.

    Parameters used inside ``function`` (closures, module weights) receive their gradients
    as usual. Random ops (dropout) see the same random numbers in the recomputation when
    ``preserve_rng_state`` is true.

    ``use_reentrant=False`` (recommended, as in PyTorch) records the segment's graph and
    drops only its saved tensors, through ``graph.saved_tensors_hooks``: it works when no
    input requires grad, with ``grad(..., inputs=...)`` on tensors inside the segment, and
    with keyword arguments. ``use_reentrant=True`` (the default when not given, as PyTorch's,
    without its warning) runs a nested backward through the recomputed segment.

    Example::

        h = aioautograd.checkpoint(block, x, use_reentrant=False)  # activations not kept
        await h.sum().backward()

    Raises:
        ValueError: for keyword arguments with ``use_reentrant=True``.
        RuntimeError: during backward, if the recomputation saves different tensors than
            the forward did (non-reentrant).
    """
    if not (use_reentrant is None or use_reentrant):
        return _checkpoint_without_reentrant(function, args, kwargs, preserve_rng_state)
    if kwargs:
        raise ValueError(
            f"Unexpected keyword arguments: {', '.join(kwargs)}; the reentrant checkpoint "
            "passes positional arguments only (use use_reentrant=False for keywords)"
        )
    if is_grad_enabled() and not any(isinstance(a, Tensor) and a.requires_grad for a in args):
        warnings.warn(
            "None of the inputs have requires_grad=True. Gradients will be None: checkpoint "
            "records its node only when an input tensor requires grad (pass the activations "
            "that lead into the segment).",
            UserWarning,
            stacklevel=2,
        )
    return CheckpointFunction.apply(function, preserve_rng_state, *args)
