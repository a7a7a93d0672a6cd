"""The CUDA backend. This is the only module that imports CuPy, and only on first use.

Streams and events wrap CuPy's. As in CuPy (and PyTorch), the current stream is a property
of the calling *thread* per device; the engine makes each node's forward stream current on
its executor thread while the node runs.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from aioautograd.devices.cuda_kernels import FusedKernels
from aioautograd.devices.device import Backend, Device
from aioautograd.devices.streams import Event, Stream

_INSTALL_HINT = (
    "install the CUDA extra with `pip install aioautograd[cuda]` "
    "(`aioautograd[cuda13]` for a CUDA 13 driver)"
)


def _import_cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(
            f"CUDA device requested but CuPy is not installed: {_INSTALL_HINT} "
            "(on a machine with an NVIDIA GPU and CUDA 12 or 13)"
        ) from exc
    return cupy


def is_available() -> bool:
    """True when CuPy is importable and sees at least one GPU."""
    try:
        return device_count() > 0
    except RuntimeError:
        return False


def device_count() -> int:
    """Number of GPUs CuPy sees (raises if CuPy is missing)."""
    cupy = _import_cupy()
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # CUDA driver missing or no device: CuPy raises its own runtime errors
        return 0


class CudaEvent(Event):
    def __init__(self, device: Device, raw: Any) -> None:
        self.device = device
        self.raw = raw

    def synchronize(self) -> None:
        self.raw.synchronize()

    def query(self) -> bool:
        return bool(self.raw.done)


class CudaStream(Stream):
    def __init__(self, device: Device, raw: Any) -> None:
        self.device = device
        self.raw = raw

    def record_event(self) -> CudaEvent:
        cupy = _import_cupy()
        with cupy.cuda.Device(self.device.index):
            event = cupy.cuda.Event(disable_timing=True)
            event.record(self.raw)
        return CudaEvent(self.device, event)

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, CudaEvent)
        self.raw.wait_event(event.raw)

    def synchronize(self) -> None:
        self.raw.synchronize()

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, CudaStream)
            and other.raw.ptr == self.raw.ptr
            and (other.device is self.device)
        )

    def __hash__(self) -> int:
        return hash((self.raw.ptr, self.device.index))

    def __repr__(self) -> str:
        return f"<CudaStream {self.raw.ptr:#x} on {self.device}>"


class CudaBackend(Backend):
    has_streams = True

    def __init__(self) -> None:
        self.xp = _import_cupy()
        self.fused = FusedKernels(self.xp)

    def check(self, index: int | None) -> None:
        count = device_count()
        if count == 0:
            raise RuntimeError(
                "CUDA device requested but no GPU is visible: CuPy is installed, but the CUDA "
                "driver reports no device. Use device='cpu' or run on a machine with a GPU."
            )
        if index is None or not 0 <= index < count:
            raise RuntimeError(f"invalid device cuda:{index}: only {count} GPU(s) are visible")

    @contextlib.contextmanager
    def device_context(self, index: int | None) -> Iterator[None]:
        with self.xp.cuda.Device(index):
            yield

    def to_host(self, array: Any) -> np.ndarray[Any, Any]:
        host: np.ndarray[Any, Any] = self.xp.asnumpy(array)
        return host

    def from_host(self, array: np.ndarray[Any, Any], index: int | None) -> Any:
        with self.xp.cuda.Device(index):
            return self.xp.asarray(array)

    def current_stream(self, index: int | None) -> CudaStream:
        # Read for every recorded node: ask for the device's stream directly, without
        # switching the current device (two runtime calls) as ``with Device(index)`` would.
        raw = self.xp.cuda.get_current_stream(0 if index is None else index)
        return CudaStream(Device("cuda", index), raw)

    def new_stream(self, index: int | None) -> CudaStream:
        with self.xp.cuda.Device(index):
            return CudaStream(Device("cuda", index), self.xp.cuda.Stream(non_blocking=True))

    @contextlib.contextmanager
    def use_stream(self, stream: Stream | None, label: str = "") -> Iterator[None]:
        if stream is None:
            yield
            return
        assert isinstance(stream, CudaStream)
        cuda, index = self.xp.cuda, stream.device.index
        if (
            cuda.runtime.getDevice() == index
            and cuda.get_current_stream(index).ptr == stream.raw.ptr
        ):
            # Already current (every node of a backward on one stream, the usual case): no
            # switch of device and stream (four runtime calls) and back, per node.
            yield
            return
        with cuda.Device(index), stream.raw:
            yield


_backend: CudaBackend | None = None
_backend_lock = threading.Lock()


def backend() -> CudaBackend:
    """The CUDA backend (imports CuPy; raises a clear error when it is missing)."""
    global _backend
    if _backend is None:
        with _backend_lock:
            if _backend is None:
                _backend = CudaBackend()
    return _backend
