"""Functional neural-network ops (``aioautograd.nn.functional``), with PyTorch's signatures.

Most functions are compositions of differentiable tensor ops, so their higher-order
gradients come for free. Three are dedicated ops here, because composing them would cost
memory or numerical stability:

- ``cross_entropy`` fuses ``log_softmax`` and the negative log-likelihood: its forward
  never materialises a one-hot matrix, and its backward, ``(softmax(x) * s - q) * grad``,
  is written with tensor ops (recomputing ``log_softmax`` differentiably only under
  ``create_graph=True``).
- ``embedding`` gathers rows; its backward scatter-adds (repeated indices accumulate) and
  leaves the ``padding_idx`` row at zero.
- ``conv2d`` runs on ``Im2Col`` / ``Col2Im``, a pair of linear ops that are each other's
  backward, followed by one batched matmul per group.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from aioautograd.devices.device import Device
from aioautograd.factories import as_tensor, generator
from aioautograd.grad_mode import is_grad_enabled
from aioautograd.ops import reduction, unary
from aioautograd.ops._util import Op, wrap
from aioautograd.tensor import Tensor

__all__ = [
    "conv2d",
    "cross_entropy",
    "dropout",
    "embedding",
    "gelu",
    "layer_norm",
    "linear",
    "log_softmax",
    "mse_loss",
    "relu",
    "softmax",
]

_REDUCTIONS = ("none", "mean", "sum")


def _check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{reduction} is not a valid value for reduction")


def _check_same_device(name: str, *tensors: Tensor | None) -> None:
    present = [t for t in tensors if t is not None]
    for tensor in present[1:]:
        if tensor.device is not present[0].device:
            raise RuntimeError(
                f"{name}: expected all tensors to be on the same device, but found at least "
                f"two devices, {present[0].device} and {tensor.device}!"
            )


# --------------------------------------------------------------------------- activations
def relu(input: Tensor) -> Tensor:
    """Elementwise ``max(input, 0)``."""
    return unary.relu(input)


def gelu(input: Tensor, approximate: str = "none") -> Tensor:
    """Gaussian error linear unit: ``x * Phi(x)``, or its ``tanh`` approximation.

    Raises:
        ValueError: if ``approximate`` is not ``"none"`` or ``"tanh"``.
    """
    return unary.gelu(input, approximate)  # type: ignore[arg-type]  # unary.gelu validates


def _implicit_softmax_dim(name: str, ndim: int) -> int:
    dim = 0 if ndim in (0, 1, 3) else 1
    warnings.warn(
        f"Implicit dimension choice for {name} has been deprecated. "
        f"Change the call to include dim={dim} as an argument.",
        UserWarning,
        stacklevel=3,
    )
    return dim


def softmax(input: Tensor, dim: int | None = None, *, dtype: Any = None) -> Tensor:
    """``exp(x) / exp(x).sum(dim)``, computed stably; ``dtype`` casts the input first."""
    if dim is None:
        dim = _implicit_softmax_dim("softmax", input.ndim)
    if dtype is not None:
        input = input.to(dtype)
    return reduction.softmax(input, dim)


def log_softmax(input: Tensor, dim: int | None = None, *, dtype: Any = None) -> Tensor:
    """``x - logsumexp(x, dim)``; ``dtype`` casts the input first."""
    if dim is None:
        dim = _implicit_softmax_dim("log_softmax", input.ndim)
    if dtype is not None:
        input = input.to(dtype)
    return reduction.log_softmax(input, dim)


def dropout(input: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by ``1 / (1 - p)``.

    The mask is drawn from :func:`aioautograd.factories.generator` (seeded by
    ``manual_seed``). With ``training=False`` or ``p=0`` the input is returned as is; with
    ``p=1`` the result (and the gradient) is all zeros.

    Raises:
        ValueError: if ``p`` is not in ``[0, 1]``.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return input
    if p == 1.0:
        return input * 0.0
    keep = generator().random(input.shape) >= p
    mask = as_tensor((keep * (1.0 / (1.0 - p))).astype(input.dtype), device=input.device)
    return input * mask


# ---------------------------------------------------------------------------- linear
class LinearFunction(Op):
    """``input @ weight.T + bias`` as one node: its backward computes the weight gradient
    as ``grad.T @ input``, contiguous in the weight's layout (no transposed copy in
    ``AccumulateGrad``), with leading input dimensions folded into one product."""

    @staticmethod
    def forward(ctx: Any, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        lead = input.shape[:-1]
        rows = input.data.reshape(-1, input.shape[-1])
        out = input.device.backend.matmul(rows, weight.data.T)
        if bias is not None:
            out += bias.data
        ctx.save_for_backward(input, weight)
        return wrap(out.reshape((*lead, weight.shape[0])), input.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        input, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        rows = grad.reshape(-1, weight.shape[0])
        grad_input = (rows @ weight).reshape(input.shape) if needs[0] else None
        grad_weight = rows.mT @ input.reshape(-1, weight.shape[1]) if needs[1] else None
        grad_bias = rows.sum(0) if needs[2] else None
        return grad_input, grad_weight, grad_bias


def linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``input @ weight.T + bias`` with ``weight`` of shape ``(out_features, in_features)``.

    ``input`` is ``(*, in_features)``; leading dimensions are folded into one matrix product,
    so the weight gradient is a single product as well.

    Raises:
        RuntimeError: if the feature sizes differ (the message gives both shapes).
    """
    _check_same_device("linear", input, weight, bias)
    if weight.ndim not in (1, 2):
        raise RuntimeError(
            f"linear: weight must be 1-D or 2-D (out_features, in_features), got shape "
            f"{tuple(weight.shape)}"
        )
    if input.ndim == 0 or input.shape[-1] != weight.shape[-1]:
        rows = math.prod(input.shape[:-1]) if input.ndim else 1
        cols = input.shape[-1] if input.ndim else 1
        weight_t = tuple(reversed(weight.shape)) if weight.ndim == 2 else (weight.shape[0], 1)
        raise RuntimeError(
            f"mat1 and mat2 shapes cannot be multiplied ({rows}x{cols} and "
            f"{weight_t[0]}x{weight_t[1]})"
        )
    if weight.ndim == 2 and input.ndim >= 2:
        return LinearFunction.apply(input, weight, bias)  # type: ignore[no-any-return]
    matrix = weight.mT if weight.ndim == 2 else weight
    if input.ndim > 2:
        lead = input.shape[:-1]
        out = input.reshape(-1, input.shape[-1]) @ matrix
        out = out.reshape(lead + out.shape[1:])
    else:
        out = input @ matrix
    return out if bias is None else out + bias


# ------------------------------------------------------------------------------ losses
def mse_loss(
    input: Tensor,
    target: Tensor,
    *,
    reduction: str = "mean",
) -> Tensor:
    """Mean squared error ``(input - target) ** 2``, reduced by ``"mean"``, ``"sum"`` or not
    at all (``"none"``). Different shapes broadcast, with PyTorch's warning.
    """
    _check_reduction(reduction)
    _check_same_device("mse_loss", input, target)
    if tuple(target.shape) != tuple(input.shape):
        try:
            np.broadcast_shapes(input.shape, target.shape)
        except ValueError:
            raise RuntimeError(
                f"mse_loss: the size of input {tuple(input.shape)} must match (or broadcast "
                f"with) the size of target {tuple(target.shape)}"
            ) from None
        warnings.warn(
            f"Using a target size ({tuple(target.shape)}) that is different to the input size "
            f"({tuple(input.shape)}). This will likely lead to incorrect results due to "
            "broadcasting. Please ensure they have the same size.",
            UserWarning,
            stacklevel=2,
        )
    diff = input - target
    loss = diff * diff
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    return loss


@dataclass(frozen=True)
class _CrossEntropySetup:
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
        setup: _CrossEntropySetup,
    ) -> Tensor:
        xp = input.xp
        dim = setup.class_dim
        shifted = input.data - input.data.max(axis=dim, keepdims=True)
        log_probs = shifted - xp.log(xp.exp(shifted).sum(axis=dim, keepdims=True))
        if setup.class_indices:
            losses, denominator, class_targets = _class_index_losses(
                xp, log_probs, target.data, setup, input.device
            )
            ctx.class_targets = class_targets
        else:
            losses, denominator = _probability_losses(xp, log_probs, target.data, setup)
        if ctx.needs_input_grad:
            ctx.save_for_backward(input, target, Tensor(log_probs, input.device))
            ctx.setup, ctx.denominator = setup, denominator
            ctx.saved_device = input.device
        if setup.reduction == "none":
            return wrap(losses, input.device)
        total = losses.sum()
        if setup.reduction == "sum":
            return wrap(total, input.device)
        with np.errstate(invalid="ignore", divide="ignore"):  # all targets ignored: nan
            return wrap(total / denominator, input.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        setup: _CrossEntropySetup = ctx.setup
        dim = setup.class_dim
        needs = ctx.needs_input_grad
        if setup.class_indices and needs[0] and not is_grad_enabled():
            # Nothing to record (a plain backward): the formula below on the arrays.
            xp, g = grad.xp, grad.data
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


def _class_index_grad(ctx: Any, xp: Any, g: Any, setup: _CrossEntropySetup) -> Tensor:
    """``(softmax(x) * sum_c q - q) * g`` for class-index targets, on the arrays."""
    input_data, target, log_probs = ctx.saved_arrays
    probs = xp.exp(log_probs)
    if setup.weight is None and not setup.label_smoothing and probs.ndim == 2:
        # q is the one-hot of the target (zero on ignored rows): subtract it in place. No
        # branch on the data (a host sync on a GPU): ignored rows are zeroed and subtract 0.
        safe, target_weight = ctx.class_targets  # forward's
        probs *= xp.expand_dims(target_weight, 1)
        probs[xp.arange(target.shape[0]), safe] -= target_weight
        probs *= g
        return wrap(probs, ctx.saved_device)
    device = ctx.saved_device
    q, total = _class_index_distribution(Tensor(input_data, device), Tensor(target, device), setup)
    return wrap((probs * total.data - q.data) * g, device)


def _target_weights(
    xp: Any, target: Any, setup: _CrossEntropySetup, dtype: Any, device: Device
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
    xp: Any, log_probs: Any, target: Any, setup: _CrossEntropySetup, device: Device
) -> tuple[Any, Any, tuple[Any, Any]]:
    """Per-position losses, their total weight, and ``(safe_target, target_weight)``."""
    dim, smoothing = setup.class_dim, setup.label_smoothing
    valid, safe, target_weight = _target_weights(xp, target, setup, log_probs.dtype, device)
    picked = xp.take_along_axis(log_probs, xp.expand_dims(safe, dim), axis=dim)
    losses = -(1.0 - smoothing) * target_weight * picked.squeeze(dim)
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
    setup: _CrossEntropySetup,
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
    xp: Any, log_probs: Any, target: Any, setup: _CrossEntropySetup
) -> tuple[Any, Any]:
    q = target
    if setup.label_smoothing:
        q = target * (1.0 - setup.label_smoothing) + setup.label_smoothing / setup.num_classes
    if setup.weight is not None:
        q = q * setup.weight.reshape(setup.broadcast_shape(log_probs.ndim))
    losses = -(log_probs * q).sum(axis=setup.class_dim)
    return losses, xp.asarray(log_probs.size / setup.num_classes, dtype=log_probs.dtype)


def cross_entropy(
    input: Tensor,
    target: Tensor,
    weight: Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """Cross entropy between the logits ``input`` and ``target``, as PyTorch computes it.

    ``input`` is ``(C,)``, ``(N, C)`` or ``(N, C, d1, ...)`` (classes on dimension 1, or 0
    for a 1-D input). ``target`` holds either class indices (an integer tensor shaped like
    ``input`` without the class dimension; positions equal to ``ignore_index`` contribute
    nothing) or class probabilities (a floating tensor shaped like ``input``).

    Args:
        weight: per-class rescaling, shape ``(C,)`` (not differentiated).
        reduction: ``"mean"`` (divided by the summed target weights for class indices, by
            the number of positions for probabilities), ``"sum"`` or ``"none"``.
        label_smoothing: in ``[0, 1]``; mixes the target with the uniform distribution.

    Raises:
        RuntimeError: on mismatched shapes or devices (the message gives the shapes).
        IndexError: if a class index is out of range.
        ValueError: on an unknown ``reduction`` or ``label_smoothing`` outside ``[0, 1]``.
    """
    _check_reduction(reduction)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be between 0.0 and 1.0. Got: {label_smoothing}")
    _check_same_device("cross_entropy", input, target, weight)
    if input.dtype.kind != "f":
        raise RuntimeError(f"cross_entropy: expected floating point input, got {input.dtype}")
    if input.ndim == 0:
        raise RuntimeError("cross_entropy: input must have at least 1 dimension (the classes)")
    class_dim = 0 if input.ndim == 1 else 1
    num_classes = input.shape[class_dim]
    class_indices = target.dtype.kind in "iu"
    if class_indices:
        expected = input.shape[:class_dim] + input.shape[class_dim + 1 :]
        if tuple(target.shape) != tuple(expected):
            raise RuntimeError(
                f"cross_entropy: expected class-index target of size {list(expected)} for input "
                f"of size {list(input.shape)}, got target of size {list(target.shape)}"
            )
    elif target.dtype.kind == "f":
        if tuple(target.shape) != tuple(input.shape):
            raise RuntimeError(
                f"cross_entropy: expected class-probability target of size {list(input.shape)} "
                f"(the input's size), got target of size {list(target.shape)}; class-index "
                "targets must be integer tensors"
            )
    else:
        raise RuntimeError(
            f"cross_entropy: target must hold class indices (integer) or class probabilities "
            f"(floating point), got {target.dtype}"
        )
    weight_data = None
    if weight is not None:
        if weight.ndim != 1 or weight.shape[0] != num_classes:
            raise RuntimeError(
                f"weight tensor should be defined either for all {num_classes} classes or no "
                f"classes but got weight tensor of shape: {list(weight.shape)}"
            )
        if weight.requires_grad and is_grad_enabled():
            raise RuntimeError("cross_entropy: the derivative for 'weight' is not implemented")
        weight_data = weight.data.astype(input.dtype, copy=False)
    setup = _CrossEntropySetup(
        class_dim,
        num_classes,
        class_indices,
        weight_data,
        ignore_index,
        reduction,
        float(label_smoothing),
    )
    return CrossEntropy.apply(input, target, setup)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- embedding
class Embedding(Op):
    """Rows ``weight[indices]``; the backward scatter-adds into the rows (no padding row)."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor, indices: Tensor, padding_idx: int | None) -> Tensor:
        if ctx.needs_input_grad:
            ctx.save_for_backward(indices)
            ctx.num_weights, ctx.padding_idx = weight.shape[0], padding_idx
        return Tensor(weight.xp.take(weight.data, indices.data, axis=0), weight.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (indices,) = ctx.saved_tensors
        grad_weight = EmbeddingBackward.apply(grad, indices, ctx.num_weights, ctx.padding_idx)
        return grad_weight, None, None


class EmbeddingBackward(Op):
    """Scatter-add ``grad`` rows into a zero ``(num_weights, D)`` matrix at ``indices``."""

    @staticmethod
    def forward(
        ctx: Any, grad: Tensor, indices: Tensor, num_weights: int, padding_idx: int | None
    ) -> Tensor:
        if ctx.needs_input_grad:
            ctx.save_for_backward(indices)
            ctx.num_weights, ctx.padding_idx = num_weights, padding_idx
        xp = grad.xp
        width = grad.shape[indices.ndim :]
        out = xp.zeros((num_weights, *width), dtype=grad.dtype)
        xp.add.at(out, indices.data.reshape(-1), grad.data.reshape((-1, *width)))
        if padding_idx is not None:
            out[padding_idx] = 0
        return Tensor(out, grad.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        # The adjoint of scatter-add is a gather; the padding row received nothing, so
        # positions pointing at it get nothing back.
        if ctx.padding_idx is not None:
            keep = grad.xp.ones((ctx.num_weights,) + (1,) * (grad.ndim - 1), dtype=grad.dtype)
            keep[ctx.padding_idx] = 0
            grad = grad * Tensor(keep, grad.device)
        (indices,) = ctx.saved_tensors
        return Embedding.apply(grad, indices, ctx.padding_idx), None, None, None


def embedding(
    input: Tensor,
    weight: Tensor,
    padding_idx: int | None = None,
) -> Tensor:
    """Look up the rows of ``weight`` (``(num_embeddings, embedding_dim)``) at the integer
    indices ``input``: the result has shape ``input.shape + (embedding_dim,)``.

    Gradients of repeated indices accumulate; the ``padding_idx`` row gets no gradient.

    Raises:
        IndexError: if an index is out of range.
        RuntimeError: if ``input`` is not an integer tensor or ``weight`` is not 2-D.
        ValueError: if ``padding_idx`` is out of range.
    """
    _check_same_device("embedding", input, weight)
    if weight.ndim != 2:
        raise RuntimeError(f"'weight' must be 2-D, got shape {tuple(weight.shape)}")
    if input.dtype.kind not in "iu":
        raise RuntimeError(
            "Expected tensor for argument #1 'indices' to have an integer dtype (int64, int32), "
            f"but got {input.dtype} instead"
        )
    num_weights = weight.shape[0]
    if padding_idx is not None:
        if not -num_weights <= padding_idx < num_weights:
            raise ValueError(
                f"padding_idx must be within num_embeddings ({num_weights}), got {padding_idx}"
            )
        padding_idx %= num_weights
    if input.numel() and (bool((input.data < 0).any()) or bool((input.data >= num_weights).any())):
        raise IndexError(f"index out of range in self (num_embeddings is {num_weights})")
    return Embedding.apply(weight, input, padding_idx)  # type: ignore[no-any-return]


# -------------------------------------------------------------------------- layer_norm
def layer_norm(
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """Normalise over the trailing ``normalized_shape`` dimensions (biased variance), then
    apply the elementwise affine ``weight`` and ``bias`` (each of ``normalized_shape``).

    Raises:
        RuntimeError: if the input's trailing dimensions, ``weight`` or ``bias`` do not match
            ``normalized_shape`` (the message gives the shapes).
    """
    _check_same_device("layer_norm", input, weight, bias)
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    count = len(shape)
    if count == 0 or input.ndim < count or tuple(input.shape[-count:]) != shape:
        raise RuntimeError(
            f"Given normalized_shape={list(shape)}, expected input with shape "
            f"[*, {', '.join(map(str, shape))}], but got input of size {list(input.shape)}"
        )
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None and tuple(param.shape) != shape:
            raise RuntimeError(
                f"Expected {name} to be of same shape as normalized_shape, but got {name} of "
                f"shape {list(param.shape)} and normalized_shape = {list(shape)}"
            )
    dims = tuple(range(input.ndim - count, input.ndim))
    centered = input - input.mean(dims, keepdim=True)
    variance = (centered * centered).mean(dims, keepdim=True)
    out = centered * (variance + eps) ** -0.5
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out


# ------------------------------------------------------------------------------ conv2d
@dataclass(frozen=True)
class _ConvGeometry:
    """Where the windows of a 2-D convolution lie in its (N, C, H, W) input."""

    input_shape: tuple[int, int, int, int]
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[tuple[int, int], tuple[int, int]]  # (top, bottom), (left, right)
    dilation: tuple[int, int]
    output: tuple[int, int]

    def padded_shape(self) -> tuple[int, int, int, int]:
        n, c, h, w = self.input_shape
        (top, bottom), (left, right) = self.padding
        return n, c, h + top + bottom, w + left + right

    def window(self, i: int, j: int) -> tuple[slice, slice]:
        """The rows and columns of the padded input that kernel tap ``(i, j)`` reads."""
        row = i * self.dilation[0]
        col = j * self.dilation[1]
        (out_h, out_w), (stride_h, stride_w) = self.output, self.stride
        return (
            slice(row, row + stride_h * (out_h - 1) + 1, stride_h),
            slice(col, col + stride_w * (out_w - 1) + 1, stride_w),
        )


class Im2Col(Op):
    """``(N, C, H, W)`` -> ``(C, kh, kw, N, OH, OW)``: every kernel tap's view of the input.

    Channels lead so that ``reshape(groups, C/groups * kh * kw, N * OH * OW)`` is free and
    the convolution is one matrix product per group (batch folded into the columns).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, geometry: _ConvGeometry) -> Tensor:
        ctx.geometry = geometry
        xp, data = x.xp, x.data
        (top, bottom), (left, right) = geometry.padding
        if top or bottom or left or right:
            data = xp.pad(data, ((0, 0), (0, 0), (top, bottom), (left, right)))
        n, c = geometry.input_shape[:2]
        (kh, kw), (out_h, out_w) = geometry.kernel, geometry.output
        cols = xp.empty((c, kh, kw, n, out_h, out_w), dtype=data.dtype)
        for i in range(kh):
            for j in range(kw):
                rows, columns = geometry.window(i, j)
                cols[:, i, j] = data[:, :, rows, columns].transpose(1, 0, 2, 3)
        return Tensor(cols, x.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return Col2Im.apply(grad, ctx.geometry), None


class Col2Im(Op):
    """The adjoint of :class:`Im2Col`: add every tap's columns back onto the input grid."""

    @staticmethod
    def forward(ctx: Any, cols: Tensor, geometry: _ConvGeometry) -> Tensor:
        ctx.geometry = geometry
        xp, data = cols.xp, cols.data
        out = xp.zeros(geometry.padded_shape(), dtype=data.dtype)
        kh, kw = geometry.kernel
        for i in range(kh):
            for j in range(kw):
                rows, columns = geometry.window(i, j)
                # Within one tap the strided positions are distinct, so += is a scatter-add.
                out[:, :, rows, columns] += data[:, i, j].transpose(1, 0, 2, 3)
        (top, bottom), (left, right) = geometry.padding
        if top or bottom or left or right:
            height, width = geometry.input_shape[2:]
            out = xp.ascontiguousarray(out[:, :, top : top + height, left : left + width])
        return Tensor(out, cols.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return Im2Col.apply(grad, ctx.geometry), None


def _pair(value: int | Sequence[int], name: str) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    pair = tuple(int(v) for v in value)
    if len(pair) == 1:
        return pair[0], pair[0]
    if len(pair) != 2:
        raise RuntimeError(f"conv2d: expected {name} to be a single integer or a pair, got {value}")
    return pair[0], pair[1]


def _conv_padding(
    padding: int | Sequence[int] | str,
    kernel: tuple[int, int],
    stride: tuple[int, int],
    dilation: tuple[int, int],
) -> tuple[tuple[int, int], tuple[int, int]]:
    if isinstance(padding, str):
        if padding == "valid":
            return (0, 0), (0, 0)
        if padding != "same":
            raise ValueError(
                f"Invalid padding string {padding!r}, should be one of 'valid', 'same'"
            )
        if stride != (1, 1):
            raise ValueError("padding='same' is not supported for strided convolutions")
        # As PyTorch: the odd pixel of an even total goes to the bottom/right.
        totals = [d * (k - 1) for d, k in zip(dilation, kernel, strict=True)]
        return (totals[0] // 2, totals[0] - totals[0] // 2), (
            totals[1] // 2,
            totals[1] - totals[1] // 2,
        )
    pad_h, pad_w = _pair(padding, "padding")
    if pad_h < 0 or pad_w < 0:
        raise RuntimeError("negative padding is not supported")
    return (pad_h, pad_h), (pad_w, pad_w)


def conv2d(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] | str = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
) -> Tensor:
    """2-D convolution (cross-correlation, as PyTorch) of ``input`` ``(N, C_in, H, W)`` (or
    unbatched ``(C_in, H, W)``) with ``weight`` ``(C_out, C_in / groups, kh, kw)``.

    ``padding`` is an int, a pair, ``"valid"`` or ``"same"`` (stride 1 only). Computed by
    im2col and one matrix product per group; every step is differentiable, so
    ``create_graph=True`` works to any order.

    Raises:
        RuntimeError: on inconsistent shapes, channels or groups (the message gives the
            shapes), or a kernel larger than the padded input.
        ValueError: on an unknown padding string or ``"same"`` with a stride.
    """
    _check_same_device("conv2d", input, weight, bias)
    if input.ndim not in (3, 4):
        raise RuntimeError(
            "Expected 3D (unbatched) or 4D (batched) input to conv2d, but got input of size: "
            f"{list(input.shape)}"
        )
    if weight.ndim != 4:
        raise RuntimeError(
            f"Expected 4-dimensional weight for {input.ndim}-dimensional input "
            f"{list(input.shape)}, but got {weight.ndim}-dimensional weight of size "
            f"{list(weight.shape)} instead"
        )
    if groups <= 0:
        raise RuntimeError("non-positive groups is not supported")
    stride_pair = _pair(stride, "stride")
    dilation_pair = _pair(dilation, "dilation")
    if min(stride_pair) <= 0:
        raise RuntimeError("non-positive stride is not supported")
    if min(dilation_pair) <= 0:
        raise RuntimeError("dilation should be greater than zero")
    out_channels, group_channels, kh, kw = weight.shape
    unbatched = input.ndim == 3
    if unbatched:
        input = input.unsqueeze(0)
    n, channels, height, width = input.shape
    if out_channels % groups:
        raise RuntimeError(
            f"Given groups={groups}, expected weight to be divisible by {groups} at dimension "
            f"0, but got weight of size {list(weight.shape)} instead"
        )
    if channels != group_channels * groups:
        raise RuntimeError(
            f"Given groups={groups}, weight of size {list(weight.shape)}, expected "
            f"input{list(input.shape)} to have {group_channels * groups} channels, but got "
            f"{channels} channels instead"
        )
    if bias is not None and tuple(bias.shape) != (out_channels,):
        raise RuntimeError(
            f"Given weight of size {list(weight.shape)}, expected bias to be 1-dimensional "
            f"with {out_channels} elements, but got bias of size {list(bias.shape)} instead"
        )
    kernel = (kh, kw)
    pad = _conv_padding(padding, kernel, stride_pair, dilation_pair)
    padded = (height + sum(pad[0]), width + sum(pad[1]))
    extent = tuple(d * (k - 1) + 1 for d, k in zip(dilation_pair, kernel, strict=True))
    if padded[0] < extent[0] or padded[1] < extent[1]:
        raise RuntimeError(
            f"Calculated padded input size per channel: ({padded[0]} x {padded[1]}). Kernel "
            f"size: ({extent[0]} x {extent[1]}). Kernel size can't be greater than actual "
            "input size"
        )
    output = (
        (padded[0] - extent[0]) // stride_pair[0] + 1,
        (padded[1] - extent[1]) // stride_pair[1] + 1,
    )
    geometry = _ConvGeometry(
        (n, channels, height, width), kernel, stride_pair, pad, dilation_pair, output
    )
    cols: Tensor = Im2Col.apply(input, geometry)
    taps = group_channels * kh * kw
    columns = cols.reshape(groups, taps, n * output[0] * output[1])
    out = weight.reshape(groups, out_channels // groups, taps) @ columns
    out = out.reshape(out_channels, n, *output).permute(1, 0, 2, 3)
    if bias is not None:
        out = out + bias.reshape(out_channels, 1, 1)
    return out.squeeze(0) if unbatched else out
