"""Functional neural-network ops (``aioautograd.nn.functional``), with PyTorch's signatures.

The thin API: argument checks with PyTorch's messages, then either a composition of
differentiable tensor ops (higher-order gradients for free) or one of the fused ops of
``aioautograd/ops/``, where every derivative rule lives: ``linear`` (``ops/linalg.py``),
``cross_entropy`` (``ops/loss.py``), ``embedding`` (``ops/embedding.py``) and ``conv2d``
(im2col in ``ops/conv.py``, then one batched matmul per group).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from aioautograd.factories import as_tensor, generator
from aioautograd.grad_mode import is_grad_enabled
from aioautograd.ops import reduction, unary
from aioautograd.ops.conv import ConvGeometry, Im2Col
from aioautograd.ops.embedding import Embedding
from aioautograd.ops.linalg import LinearFunction
from aioautograd.ops.loss import CrossEntropy, CrossEntropySetup
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
def relu(input: Tensor, inplace: bool = False) -> Tensor:
    """Elementwise ``max(input, 0)``; with ``inplace`` written into ``input`` itself (no new
    activation array: ``input`` must not be needed elsewhere, as in PyTorch)."""
    return input.relu_() if inplace else unary.relu(input)


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
        return LinearFunction.apply(input, weight, bias)
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
    device = input.device
    if target.device is not device or (weight is not None and weight.device is not device):
        _check_same_device("cross_entropy", input, target, weight)  # (raises, saying why)
    # (the arrays' attributes: the tensors' properties are a Python call each)
    input_data, target_data = input.data, target.data
    if input_data.dtype.kind != "f":
        raise RuntimeError(f"cross_entropy: expected floating point input, got {input.dtype}")
    shape = input_data.shape
    if not shape:
        raise RuntimeError("cross_entropy: input must have at least 1 dimension (the classes)")
    class_dim = 0 if len(shape) == 1 else 1
    num_classes = shape[class_dim]
    class_indices = target_data.dtype.kind in "iu"
    if class_indices:
        expected = shape[:class_dim] + shape[class_dim + 1 :]
        if tuple(target_data.shape) != tuple(expected):
            raise RuntimeError(
                f"cross_entropy: expected class-index target of size {list(expected)} for input "
                f"of size {list(input.shape)}, got target of size {list(target.shape)}"
            )
    elif target_data.dtype.kind == "f":
        if tuple(target_data.shape) != tuple(shape):
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
    setup = CrossEntropySetup(
        class_dim,
        num_classes,
        class_indices,
        weight_data,
        ignore_index,
        reduction,
        float(label_smoothing),
    )
    return CrossEntropy.apply(input, target, setup)


# --------------------------------------------------------------------------- embedding
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
    return Embedding.apply(weight, input, padding_idx)


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
    geometry = ConvGeometry(
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
