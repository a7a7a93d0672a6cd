"""Shared by the layers: allocating an uninitialised parameter on a device, in a dtype."""

from __future__ import annotations

from typing import Any

from aioautograd._typing import DeviceLike, DTypeLike
from aioautograd.factories import empty
from aioautograd.nn.parameter import Parameter


def new_parameter(shape: tuple[int, ...], device: DeviceLike, dtype: DTypeLike) -> Parameter:
    """An uninitialised parameter (float32 unless ``dtype`` says otherwise)."""
    return Parameter(empty(shape, dtype=dtype, device=device))


def ntuple(value: Any, name: str) -> tuple[int, int]:
    """``value`` (an int or a pair) as a pair of ints."""
    if isinstance(value, int):
        return value, value
    pair = tuple(int(v) for v in value)
    if len(pair) != 2:
        raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}")
    return pair[0], pair[1]
