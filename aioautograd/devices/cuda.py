"""The CUDA backend. This is the only module that imports CuPy, and only on first use."""

from __future__ import annotations

from typing import Any

_INSTALL_HINT = "install the CUDA extra with `pip install aioautograd[cuda]`"


def _import_cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(
            f"CUDA device requested but CuPy is not installed: {_INSTALL_HINT} "
            "(on a machine with an NVIDIA GPU and CUDA 12)"
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


def array_module(index: int) -> Any:
    """Return CuPy after checking that ``cuda:index`` exists."""
    cupy = _import_cupy()
    count = device_count()
    if count == 0:
        raise RuntimeError(
            "CUDA device requested but no GPU is visible: CuPy is installed, but the CUDA "
            "driver reports no device. Use device='cpu' or run on a machine with a GPU."
        )
    if not 0 <= index < count:
        raise RuntimeError(f"invalid device cuda:{index}: only {count} GPU(s) are visible")
    return cupy
