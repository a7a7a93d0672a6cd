"""Freed memory kept for reuse in the process (glibc's ``malloc``), instead of being handed
back to the kernel after every training step and faulted back in during the next.

glibc serves a large allocation with a fresh ``mmap`` (each of its pages faults in when first
written) while it is above the *mmap threshold*, and hands the free top of its heap back to
the kernel once it exceeds the *trim threshold*. Both adapt to the program (after a mapped
block of up to 32 MiB is freed, the mmap threshold becomes its size and the trim threshold
twice that), but a training step that allocates and frees many arrays of a few hundred KB
keeps crossing the trim threshold:
- the flagship example's model (2-128-128-3, 1,200 points: activations of 600 KB, weights of
  64 KB) took ~420 page faults per step, 1.7-2.7 ms of system time, and its steps ran
  30-40% longer than with the thresholds below (``benchmarks/README.md``, session 32);
- each worker process of the model-parallel step took 80-110 page faults per step, ~0.4-0.8
  ms of its event loop (issue #15, session 26).
Models whose steps also free larger blocks (a 1024x1024 weight's gradient) move glibc's
thresholds far enough themselves and fault little either way.

:func:`keep_freed_memory` sets the thresholds where glibc's own rule ends (mmap 32 MiB, trim
64 MiB): the process then keeps up to 64 MiB of freed memory for its next allocations. The
engine applies it when its policy configures the CPU budget (``EnginePolicy.keep_freed_memory``),
a ``grpc`` worker when it starts (``GrpcOptions.keep_freed_memory``).
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit systems
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # as glibc's rule sets it from the mmap threshold

# The user's own settings win: glibc reads these at start-up.
_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds to 32 and 64 MiB for this process.

    Returns True when they were set; False without glibc (another C library, another
    system), or when the environment already sets them (``MALLOC_TRIM_THRESHOLD_``,
    ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TOP_PAD_``, or a ``glibc.malloc`` tunable in
    ``GLIBC_TUNABLES``): those are left as they are.
    """
    if not sys.platform.startswith("linux"):
        return False
    if any(name in os.environ for name in _USER_SETTINGS):
        return False
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl has a mallopt that does nothing)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # The mmap threshold first: setting either one ends glibc's adaptation of both.
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
