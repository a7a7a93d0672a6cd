"""Losses with a fused derivative rule: ``CrossEntropy`` (``nn.functional.cross_entropy``).

``cross_entropy`` fuses ``log_softmax`` and the negative log-likelihood: its forward never
materialises a one-hot matrix, and its backward, ``(softmax(x) * s - q) * grad``, is written
with tensor ops (recomputing ``log_softmax`` differentiably only under ``create_graph=True``;
a plain backward with class indices computes the same formula on the arrays).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from aioautograd.devices.device import Device
from aioautograd.grad_mode import is_grad_enabled
from aioautograd.ops._util import Op, wrap
from aioautograd.tensor import Tensor


@dataclass(frozen=True)
class CrossEntropySetup:
    """The validated, non-tensor arguments of one ``cross_entropy`` call."""

    class_dim: int
    num_classes: int
    class_indices: bool
    weight: Any  # the weight's array, or None
    ignore_index: int
    reduction: str
    label_smoothing: float

    def broadcast_shape(self, ndim: int) -> tuple[int, ...]:
        """``(C, 1, ..., 1)``: the weight lined up with the class dimension."""
        return (self.num_classes,) + (1,) * (ndim - self.class_dim - 1)

    def broadcast_weight(self, input: Tensor) -> Tensor | None:
        if self.weight is None:
            return None
        return Tensor(self.weight.reshape(self.broadcast_shape(input.ndim)), input.device)


class CrossEntropy(Op):
    """Fused ``log_softmax`` + negative log-likelihood over ``class_dim``.

    Both target kinds reduce to one formula: per position ``loss = -sum_c q_c * logp_c``,
    where ``q`` is the weighted, smoothed target distribution. Then
    ``d loss / d x = softmax(x) * sum_c q_c - q``.
    """

    @staticmethod
    def forward(
        ctx: Any,
        input: Tensor,
        target: Tensor,
        setup: CrossEntropySetup,
    ) -> Tensor:
        ctx.fused_rows = None
        fused = input.device.fused
        if fused is not None and _fusable(setup, input):
            result = fused.cross_entropy_rows(
                input.data, target.data, setup.ignore_index, setup.reduction
            )
            if result is not None:
                loss, log_probs, row_weights, ctx.denominator = result
                if ctx.needs_input_grad:
                    ctx.save_for_backward(input, target, Tensor(log_probs, input.device))
                    ctx.setup, ctx.fused_rows = setup, (target.data, row_weights)
                    ctx.saved_device = input.device
                return wrap(loss, input.device)
        xp = input.device.xp
        dim = setup.class_dim
        data = input.data
        if xp is np:
            # (the ufuncs' reductions, as ndarray.max and .sum call them, without NumPy's
            # Python wrappers: three calls per loss)
            shifted = data - np.maximum.reduce(data, dim, keepdims=True)
            log_probs = shifted - np.log(np.add.reduce(np.exp(shifted), dim, keepdims=True))
        else:
            shifted = data - data.max(axis=dim, keepdims=True)
            log_probs = shifted - xp.log(xp.exp(shifted).sum(axis=dim, keepdims=True))
        plain = setup.class_indices and _plain_targets(xp, log_probs, target.data, setup)
        if plain:
            # Every target a class in range, none ignored, no weight or smoothing: each
            # position weighs 1 (the general formula's factors of 1 are exact, left out).
            rows = target.data.shape[0]
            losses = -log_probs[np.arange(rows), target.data]
            denominator = log_probs.dtype.type(rows)
            ctx.class_targets = (target.data, None)
        elif setup.class_indices:
            losses, denominator, class_targets = _class_index_losses(
                xp, log_probs, target.data, setup, input.device
            )
            ctx.class_targets = class_targets
        else:
            losses, denominator = _probability_losses(xp, log_probs, target.data, setup)
        if ctx.needs_input_grad:
            ctx.save_for_backward(input, target, Tensor(log_probs, input.device))
            # All positions ignored: the loss is 0/0 = NaN, but its gradient 0 (PyTorch's),
            # not 0 * inf: divide by 1 instead, every weight being 0.
            ctx.setup = setup
            ctx.denominator = denominator if plain else xp.where(denominator == 0, 1, denominator)
            ctx.saved_device = input.device
        if setup.reduction == "none":
            return wrap(losses, input.device)
        total = np.add.reduce(losses, None) if xp is np else losses.sum()
        if setup.reduction == "sum" or plain:
            return wrap(total if setup.reduction == "sum" else total / denominator, input.device)
        with np.errstate(invalid="ignore", divide="ignore"):  # all targets ignored: nan
            return wrap(total / denominator, input.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        setup: CrossEntropySetup = ctx.setup
        dim = setup.class_dim
        needs = ctx.needs_input_grad
        if setup.class_indices and needs[0] and not is_grad_enabled():
            # Nothing to record (a plain backward): the formula below on the arrays.
            xp, g = grad.device.xp, grad.data
            if ctx.fused_rows is not None:
                fused = ctx.saved_device.fused
                target, row_weights = ctx.fused_rows
                log_probs = ctx.saved_arrays[2]
                result = fused.cross_entropy_rows_backward(
                    g, log_probs, target, row_weights, ctx.denominator, setup.reduction
                )
                if result is not None:
                    return wrap(result, ctx.saved_device), None, None
            if setup.reduction == "none":
                g = xp.expand_dims(g, dim)
            elif setup.reduction == "mean":
                g = g / ctx.denominator
            return _class_index_grad(ctx, xp, g, setup), None, None
        input, target, saved_log_probs = ctx.saved_tensors
        # Under create_graph the gradient must depend on the input differentiably.
        log_probs = input.log_softmax(dim) if is_grad_enabled() else saved_log_probs
        if setup.reduction == "none":
            grad = grad.unsqueeze(dim)
        elif setup.reduction == "mean":
            grad = grad / ctx.denominator
        weight = setup.broadcast_weight(input)
        grad_input = grad_target = None
        if needs[0]:
            if setup.class_indices:
                q, total = _class_index_distribution(input, target, setup)
            else:
                q = target
                if setup.label_smoothing:
                    smoothing = setup.label_smoothing
                    q = q * (1.0 - smoothing) + smoothing / setup.num_classes
                if weight is not None:
                    q = q * weight
                total = q.sum(dim, keepdim=True)
            grad_input = (log_probs.exp() * total - q) * grad
        if needs[1]:  # probability targets only: integer targets never require grad
            scale = -(1.0 - setup.label_smoothing)
            grad_target = log_probs * (scale if weight is None else weight * scale) * grad
        return grad_input, grad_target, None


def _fusable(setup: CrossEntropySetup, input: Tensor) -> bool:
    """Whether the backend's fused kernels cover this call: ``(N, C)`` logits, class
    indices, no class weight, no label smoothing."""
    return (
        setup.class_indices
        and setup.weight is None
        and not setup.label_smoothing
        and input.ndim == 2
        and setup.class_dim == 1
    )


def _class_index_grad(ctx: Any, xp: Any, g: Any, setup: CrossEntropySetup) -> Tensor:
    """``(softmax(x) * sum_c q - q) * g`` for class-index targets, on the arrays."""
    input_data, target, log_probs = ctx.saved_arrays
    probs = xp.exp(log_probs)
    if (
        setup.weight is None
        and not setup.label_smoothing
        and probs.ndim == 2
        and ctx.fused_rows is None
    ):
        # q is the one-hot of the target (zero on ignored rows): subtract it in place. No
        # branch on the data (a host sync on a GPU): ignored rows are zeroed and subtract 0.
        safe, target_weight = ctx.class_targets  # forward's
        if target_weight is None:  # every position weighs 1 (``_plain_targets``)
            probs[xp.arange(target.shape[0]), safe] -= 1.0
        else:
            probs *= target_weight[:, None]
            probs[xp.arange(target.shape[0]), safe] -= target_weight
        probs *= g
        return wrap(probs, ctx.saved_device)
    device = ctx.saved_device
    q, total = _class_index_distribution(Tensor(input_data, device), Tensor(target, device), setup)
    return wrap((probs * total.data - q.data) * g, device)


def _plain_targets(xp: Any, log_probs: Any, target: Any, setup: CrossEntropySetup) -> bool:
    """Whether every position of a ``(N, C)`` NumPy input with class-index targets weighs
    1: no class weight or smoothing, and every target a class in range (so none equals a
    negative ``ignore_index``). Checked with two reductions in C; anything else takes the
    general path (which also raises for targets out of range)."""
    return (
        xp is np
        and setup.weight is None
        and not setup.label_smoothing
        and setup.ignore_index < 0
        and log_probs.ndim == 2
        and target.size > 0
        and np.minimum.reduce(target) >= 0
        and np.maximum.reduce(target) < setup.num_classes
    )


def _target_weights(
    xp: Any, target: Any, setup: CrossEntropySetup, dtype: Any, device: Device
) -> tuple[Any, Any, Any]:
    """``(valid, safe_target, target_weight)`` per position: ignored positions are not valid,
    point at class 0 and weigh 0.

    A class index out of range raises ``IndexError`` on the CPU. On an accelerator that
    check would block the host until the device has caught up (as PyTorch, which asserts on
    the device instead): there such a position points at class 0 and weighs NaN, so that the
    loss and its gradient are NaN.
    """
    valid = target != setup.ignore_index
    safe = xp.where(valid, target, 0)
    out_of_range = (safe < 0) | (safe >= setup.num_classes)
    if device.has_streams:
        safe = xp.where(out_of_range, 0, safe)
    elif bool(out_of_range.any()):
        raise IndexError(f"Target {int(target[out_of_range].ravel()[0])} is out of bounds.")
    if setup.weight is None:
        target_weight = valid.astype(dtype)
    else:
        target_weight = xp.where(valid, setup.weight[safe], 0).astype(dtype, copy=False)
    if device.has_streams:
        target_weight = xp.where(out_of_range, np.nan, target_weight)
    return valid, safe, target_weight


def _class_index_losses(
    xp: Any, log_probs: Any, target: Any, setup: CrossEntropySetup, device: Device
) -> tuple[Any, Any, tuple[Any, Any]]:
    """Per-position losses, their total weight, and ``(safe_target, target_weight)``."""
    dim, smoothing = setup.class_dim, setup.label_smoothing
    valid, safe, target_weight = _target_weights(xp, target, setup, log_probs.dtype, device)
    if log_probs.ndim == 2 and dim == 1:
        # (batch, classes), the common case: one gather (take_along_axis costs ~10k
        # instructions more in Python, an exception caught inside NumPy included).
        picked = log_probs[xp.arange(safe.shape[0]), safe]
    else:
        picked = xp.take_along_axis(log_probs, xp.expand_dims(safe, dim), axis=dim).squeeze(dim)
    losses = -(1.0 - smoothing) * target_weight * picked
    if smoothing:
        weighted = log_probs
        if setup.weight is not None:
            weighted = log_probs * setup.weight.reshape(setup.broadcast_shape(log_probs.ndim))
        smooth = -weighted.sum(axis=dim) * valid
        losses = losses + (smoothing / setup.num_classes) * smooth
    return losses, target_weight.sum(), (safe, target_weight)


def _class_index_distribution(
    input: Tensor,
    target: Tensor,
    setup: CrossEntropySetup,
) -> tuple[Tensor, Tensor]:
    """The constant ``q`` (input's shape) and ``sum_c q`` (class dim kept) of class targets."""
    xp, dim, smoothing = input.xp, setup.class_dim, setup.label_smoothing
    valid, safe, target_weight = _target_weights(xp, target.data, setup, input.dtype, input.device)
    if setup.weight is None:
        weight_sum, weight = setup.num_classes, 1.0
    else:
        weight_sum = setup.weight.sum()
        weight = setup.weight.reshape(setup.broadcast_shape(input.ndim))
    classes = xp.arange(setup.num_classes).reshape(setup.broadcast_shape(input.ndim))
    one_hot = classes == xp.expand_dims(safe, dim)
    q = one_hot * xp.expand_dims((1.0 - smoothing) * target_weight, dim)
    total = (1.0 - smoothing) * target_weight
    if smoothing:
        uniform = smoothing / setup.num_classes
        valid = valid.astype(input.dtype)  # bool * float would promote to float64
        q = q + uniform * weight * xp.expand_dims(valid, dim)
        total = total + uniform * weight_sum * valid
    q = q.astype(input.dtype, copy=False)
    total = xp.expand_dims(total, dim).astype(input.dtype, copy=False)
    return Tensor(q, input.device), Tensor(total, input.device)


def _probability_losses(
    xp: Any, log_probs: Any, target: Any, setup: CrossEntropySetup
) -> tuple[Any, Any]:
    q = target
    if setup.label_smoothing:
        q = target * (1.0 - setup.label_smoothing) + setup.label_smoothing / setup.num_classes
    if setup.weight is not None:
        q = q * setup.weight.reshape(setup.broadcast_shape(log_probs.ndim))
    losses = -(log_probs * q).sum(axis=setup.class_dim)
    return losses, xp.asarray(log_probs.size / setup.num_classes, dtype=log_probs.dtype)
