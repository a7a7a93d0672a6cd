"""`Device`: a (type, index) pair that knows its backend and array module.

Backend choice is data, not code paths: ops call ``device.xp.<fn>`` and never branch on
CPU versus CUDA. Each device type has a `Backend` (``cpu`` here, ``cuda`` in ``cuda.py``,
``sim`` in ``simulated.py``) that knows how to move arrays and, for accelerators, streams.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from aioautograd.devices import cpu_budget as _cpu_budget_module
from aioautograd.devices.cpu_budget import cpu_budget

if TYPE_CHECKING:
    from aioautograd.devices.cuda_kernels import FusedKernels
    from aioautograd.devices.streams import Stream

_cache: dict[tuple[str, int | None], Device] = {}
# The devices in ``_cache`` whose backend has streams (none on a CPU-only run): read at the
# start of every backward pass (``stash_current_streams``).
_stream_devices: tuple[Device, ...] = ()
_cache_lock = threading.Lock()


class Backend:
    """What a device type provides. The CPU backend: NumPy, no streams."""

    xp: Any = np
    has_streams = False
    #: Fused kernels for the hot ops of a step (``cuda_kernels.py``), where the backend has
    #: them; ops run their generic ``xp`` code when this is ``None``.
    fused: FusedKernels | None = None

    def check(self, index: int | None) -> None:
        """Raise a clear error if device ``index`` cannot be used."""

    def sum_to_size(self, data: Any, shape: tuple[int, ...]) -> Any:
        """The array ``data`` summed down to ``shape``, which broadcasts to its shape (the
        computation of ``Tensor.sum_to_size``; a plain backward's gradient validation calls
        it directly, having nothing to record)."""
        lead = data.ndim - len(shape)
        if lead:
            fused = self.fused
            summed = fused.sum_leading(data, lead) if fused is not None else None
            if summed is None:
                axis = tuple(range(lead)) if lead > 1 else 0
                # (the ufunc's reduce, as ndarray.sum calls it, without its Python wrapper)
                summed = np.add.reduce(data, axis) if type(data) is np.ndarray else data.sum(axis)
            data = summed
            if data.shape == shape:  # (a bias gradient's case: no generator for the axes)
                return data
        axes = tuple(i for i, size in enumerate(shape) if size == 1 and data.shape[i] != 1)
        if axes:
            data = data.sum(axis=axes, keepdims=True)
        return data

    @contextlib.contextmanager
    def device_context(self, index: int | None) -> Iterator[None]:
        """Make ``index`` the current device of this type (CUDA's ``with Device(i)``)."""
        yield

    def to_host(self, array: Any) -> np.ndarray[Any, Any]:
        return np.asarray(array)

    def from_host(self, array: np.ndarray[Any, Any], index: int | None) -> Any:
        return array

    def current_stream(self, index: int | None) -> Stream | None:
        return None

    def new_stream(self, index: int | None) -> Stream:
        raise RuntimeError(f"{type(self).__name__} devices have no streams")

    @contextlib.contextmanager
    def use_stream(self, stream: Stream | None, label: str = "") -> Iterator[None]:
        """Make ``stream`` current on this thread/context for the duration of the block."""
        yield

    def matmul(self, a: Any, b: Any) -> Any:
        """``xp.matmul(a, b)``: every matrix product of the built-in ops goes through here."""
        return self.xp.matmul(a, b)

    def matmul_pair(self, a1: Any, b1: Any, a2: Any, b2: Any) -> tuple[Any, Any]:
        """``(a1 @ b1, a2 @ b2)``, two independent products (a backward's two gradients),
        which a backend may run side by side."""
        return self.matmul(a1, b1), self.matmul(a2, b2)


class CpuBackend(Backend):
    """NumPy, with matrix products counted against the CPU budget (``cpu_budget.py``)."""

    # A product of matrices below the budget's ``min_counted_flops`` (and ``min_split_flops``)
    # is one ``numpy.matmul`` whatever the budget's state: it is taken here, without the
    # budget's three calls per product (a small MLP's every product).

    def matmul(self, a: Any, b: Any) -> Any:
        budget = _cpu_budget_module._budget or cpu_budget()
        if a.ndim > 1 and b.ndim > 1 and 2.0 * a.size * b.shape[-1] < budget.min_counted_flops:
            return np.matmul(a, b)
        return budget.matmul(a, b)

    def matmul_pair(self, a1: Any, b1: Any, a2: Any, b2: Any) -> tuple[Any, Any]:
        budget = _cpu_budget_module._budget or cpu_budget()
        least = min(budget.min_counted_flops, budget.min_split_flops)
        if (
            a1.ndim > 1
            and b1.ndim > 1
            and a2.ndim > 1
            and b2.ndim > 1
            and 2.0 * a1.size * b1.shape[-1] < least
            and 2.0 * a2.size * b2.shape[-1] < least
        ):
            return np.matmul(a1, b1), np.matmul(a2, b2)
        return budget.matmul_pair(a1, b1, a2, b2)


CPU_BACKEND = CpuBackend()


class Device:
    """A device such as ``cpu``, ``cuda:0`` or ``sim:1``. Interned: compare with ``is``.

    Use :func:`device` to obtain one; it parses PyTorch-style strings.
    """

    __slots__ = ("backend", "fused", "index", "type", "xp")

    type: str
    index: int | None
    backend: Backend
    xp: Any
    #: The backend's fused kernels (``Backend.fused``), read per update: one slot read
    #: instead of an attribute looked up through the backend's class.
    fused: FusedKernels | None

    def __new__(cls, type: str, index: int | None = None) -> Device:
        global _stream_devices
        key = (type, index)
        dev = _cache.get(key)
        if dev is not None:
            return dev
        backend = _backend(type)
        backend.check(index)
        with _cache_lock:
            dev = _cache.get(key)
            if dev is None:
                dev = object.__new__(cls)
                dev.type = type
                dev.index = index
                dev.backend = backend
                dev.xp = backend.xp
                dev.fused = backend.fused
                _cache[key] = dev
                if backend.has_streams:
                    _stream_devices = (*_stream_devices, dev)
        return dev

    @property
    def has_streams(self) -> bool:
        return self.backend.has_streams

    def current_stream(self) -> Stream | None:
        """The stream that work on this device is issued to now (``None`` on CPU)."""
        return self.backend.current_stream(self.index)

    def __repr__(self) -> str:
        return f"device(type='{self.type}'" + (
            f", index={self.index})" if self.index is not None else ")"
        )

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Device, (self.type, self.index))


def _backend(type: str) -> Backend:
    if type == "cpu":
        return CPU_BACKEND
    if type == "cuda":
        from aioautograd.devices import cuda

        return cuda.backend()
    if type == "sim":
        from aioautograd.devices import simulated

        return simulated.BACKEND
    raise ValueError(f"unknown device type {type!r}: expected 'cpu', 'cuda[:N]' or 'sim[:N]'")


CPU = Device("cpu")


def stash_current_streams() -> dict[Device, Stream]:
    """The current stream of every accelerator device in use (PyTorch's
    ``stash_current_streams``): read on the caller's thread when a backward pass starts."""
    if not _stream_devices:
        return {}
    return {dev: stream for dev in _stream_devices if (stream := dev.current_stream()) is not None}


DEVICE_TYPES = ("cpu", "cuda", "sim")


def is_device_spec(value: object) -> bool:
    """Whether ``value`` names a device (a Device, or a string like ``"cuda:1"``)."""
    return isinstance(value, Device) or (
        isinstance(value, str) and value.partition(":")[0] in DEVICE_TYPES
    )


def device(spec: str | Device | None = None) -> Device:
    """Parse ``spec`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"sim:0"``, a Device or None).

    ``sim`` devices are the simulated accelerator used by tests (NumPy arrays, streams and
    events that log their ordering); see :mod:`aioautograd.devices.simulated`.

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
    if name in ("cuda", "sim"):
        try:
            index = int(idx) if idx else 0
        except ValueError:
            raise ValueError(f"invalid device {spec!r}: expected '{name}:N'") from None
        return Device(name, index)
    raise ValueError(f"unknown device {spec!r}: expected 'cpu', 'cuda', 'cuda:N' or 'sim:N'")
