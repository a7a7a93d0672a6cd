"""Shared type aliases (no runtime behaviour)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

if TYPE_CHECKING:
    from aioautograd.devices.device import Device

# cupy.ndarray has the same interface; it is never imported on the CPU path.
Array: TypeAlias = Any
Shape: TypeAlias = tuple[int, ...]
DeviceLike: TypeAlias = "str | Device | None"
DTypeLike: TypeAlias = "str | np.dtype[Any] | type | None"
