"""`Device`: a (type, index) pair that knows its array module.

Backend choice is data, not code paths: ops call ``device.xp.<fn>`` and never
branch on CPU versus CUDA.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

_cache: dict[tuple[str, int | None], Device] = {}
_cache_lock = threading.Lock()


class Device:
    """A device such as ``cpu`` or ``cuda:0``. Instances are interned: compare with ``is``.

    Use :func:`device` to obtain one; it parses PyTorch-style strings.
    """

    __slots__ = ("index", "type", "xp")

    type: str
    index: int | None
    xp: Any

    def __new__(cls, type: str, index: int | None = None) -> Device:
        key = (type, index)
        dev = _cache.get(key)
        if dev is not None:
            return dev
        with _cache_lock:
            dev = _cache.get(key)
            if dev is None:
                dev = object.__new__(cls)
                dev.type = type
                dev.index = index
                dev.xp = _array_module(type, index)
                _cache[key] = dev
        return dev

    def __repr__(self) -> str:
        return f"device(type='{self.type}'" + (
            f", index={self.index})" if self.index is not None else ")"
        )

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Device, (self.type, self.index))


def _array_module(type: str, index: int | None) -> Any:
    if type == "cpu":
        return np
    if type == "cuda":
        from aioautograd.devices import cuda

        return cuda.array_module(index or 0)
    raise ValueError(f"unknown device type {type!r}: expected 'cpu' or 'cuda[:N]'")


CPU = Device("cpu")


def device(spec: str | Device | None = None) -> Device:
    """Parse ``spec`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a :class:`Device` or ``None``).

    Raises:
        ValueError: for an unknown device string.
        RuntimeError: for ``cuda`` when CuPy or a GPU is missing (the message says which).
    """
    if spec is None:
        return CPU
    if isinstance(spec, Device):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"expected a device string or Device, got {type(spec).__name__}")
    name, _, idx = spec.partition(":")
    if name == "cpu":
        if idx not in ("", "0"):
            raise ValueError(f"invalid device {spec!r}: cpu has no index")
        return CPU
    if name == "cuda":
        try:
            index = int(idx) if idx else 0
        except ValueError:
            raise ValueError(f"invalid device {spec!r}: expected 'cuda:N'") from None
        return Device("cuda", index)
    raise ValueError(f"unknown device {spec!r}: expected 'cpu', 'cuda' or 'cuda:N'")
