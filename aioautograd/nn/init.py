"""Parameter initialisation (``aioautograd.nn.init``), with PyTorch's names and formulas.

Every function fills its tensor in place under ``no_grad`` (bumping its version counter)
and returns it. Random values come from :func:`aioautograd.factories.generator`, so
``manual_seed`` makes initialisation reproducible; they are drawn on the host in float64
and copied to the tensor's device and dtype.
"""

from __future__ import annotations

import math

from aioautograd.factories import generator
from aioautograd.grad_mode import no_grad
from aioautograd.ops import inplace
from aioautograd.tensor import Tensor

__all__ = [
    "calculate_gain",
    "constant_",
    "kaiming_uniform_",
    "normal_",
    "ones_",
    "uniform_",
    "xavier_uniform_",
    "zeros_",
]


def calculate_gain(nonlinearity: str, param: float | None = None) -> float:
    """The recommended gain for ``nonlinearity`` (``"linear"``, ``"relu"``,
    ``"leaky_relu"`` with negative slope ``param``, ``"tanh"``, ``"sigmoid"``, conv names).

    Raises:
        ValueError: for an unknown nonlinearity.
    """
    linear_like = ("linear", "conv1d", "conv2d", "conv3d", "sigmoid")
    if nonlinearity in linear_like:
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        slope = 0.01 if param is None else float(param)
        return math.sqrt(2.0 / (1 + slope**2))
    raise ValueError(f"Unsupported nonlinearity {nonlinearity}")


def _calculate_fan_in_and_fan_out(tensor: Tensor) -> tuple[int, int]:
    if tensor.ndim < 2:
        raise ValueError(
            "Fan in and fan out can not be computed for tensor with fewer than 2 dimensions"
        )
    receptive_field = math.prod(tensor.shape[2:])
    return tensor.shape[1] * receptive_field, tensor.shape[0] * receptive_field


def uniform_(tensor: Tensor, a: float = 0.0, b: float = 1.0) -> Tensor:
    """Fill ``tensor`` with values drawn from ``U(a, b)``."""
    return _fill(tensor, generator().uniform(a, b, tensor.shape))


def normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0) -> Tensor:
    """Fill ``tensor`` with values drawn from ``N(mean, std**2)``."""
    return _fill(tensor, generator().normal(mean, std, tensor.shape))


def constant_(tensor: Tensor, val: float) -> Tensor:
    """Fill ``tensor`` with ``val``."""
    with no_grad():
        return inplace.copy_(tensor, val)


def zeros_(tensor: Tensor) -> Tensor:
    """Fill ``tensor`` with zeros."""
    with no_grad():
        return tensor.zero_()


def ones_(tensor: Tensor) -> Tensor:
    """Fill ``tensor`` with ones."""
    return constant_(tensor, 1.0)


def kaiming_uniform_(
    tensor: Tensor,
    a: float = 0.0,
    mode: str = "fan_in",
    nonlinearity: str = "leaky_relu",
) -> Tensor:
    """He initialisation: ``U(-bound, bound)`` with ``bound = gain * sqrt(3 / fan)``.

    ``Linear`` and ``Conv2d`` use ``a=sqrt(5)``, which gives ``bound = 1 / sqrt(fan_in)``.

    Raises:
        ValueError: for a mode other than ``"fan_in"``/``"fan_out"`` or a tensor with
            fewer than 2 dimensions.
    """
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"Mode {mode} not supported, please use one of fan_in, fan_out")
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    fan = fan_in if mode == "fan_in" else fan_out
    if fan == 0:
        return tensor
    bound = calculate_gain(nonlinearity, a) * math.sqrt(3.0 / fan)
    return uniform_(tensor, -bound, bound)


def xavier_uniform_(tensor: Tensor, gain: float = 1.0) -> Tensor:
    """Glorot initialisation: ``U(-a, a)`` with ``a = gain * sqrt(6 / (fan_in + fan_out))``."""
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform_(tensor, -bound, bound)


def _fill(tensor: Tensor, values: object) -> Tensor:
    with no_grad():
        return inplace.copy_(tensor, values)
