"""A short scheduler slice for a thread awaiting offloaded work (Linux 6.12+, EEVDF).

An event loop's thread sleeps in ``epoll_wait`` most of the time and is woken by a timer or
a socket; while the engine's workers compute on every core, it then waits on the run queue
until the kernel preempts one of them. EEVDF lets a running thread finish its protected slice
first (about 1.5 ms with 2 CPUs) and notices an expired slice at the next tick (4 ms at
``HZ=250``): the loop's 1 ms timers woke 2-4 ms late that way (``benchmarks/late_ticks.py``).
A thread that asks for a shorter slice (``sched_attr.sched_runtime``, 0.1-100 ms, no
privilege needed) is picked sooner when it wakes and shortens the running thread's
protection; its share of the CPU (its weight, the nice value) does not change, so the
workers keep theirs when another process competes for the cores (unlike a nice value or
``SCHED_IDLE`` on the workers).

The engine asks for it while a thread awaits an ``offload`` (``EnginePolicy.loop_slice_s``)
and gives its slice back when none is in flight . Not for a thread that computes (a
forward pass in a coroutine, an engine worker): with a short slice it is preempted at once
by every thread woken on its CPU, and natural-code training at once took 10-20% longer
(benchmarks/README.md, s30-t12). A thread that is not ``SCHED_OTHER``, or whose slice is
already that short, is left as it is; elsewhere than Linux on x86-64 or arm64 nothing
changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import sys
import threading
from typing import Any

# sched_setattr / sched_getattr system call numbers.
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}
_NUMBERS = _SYSCALLS.get(platform.machine()) if sys.platform.startswith("linux") else None
_SCHED_OTHER = 0


class _SchedAttr(ctypes.Structure):
    # ``struct sched_attr`` up to ``sched_period`` (SCHED_ATTR_SIZE_VER0, 48 bytes).
    _fields_ = [
        ("size", ctypes.c_uint32),
        ("sched_policy", ctypes.c_uint32),
        ("sched_flags", ctypes.c_uint64),
        ("sched_nice", ctypes.c_int32),
        ("sched_priority", ctypes.c_uint32),
        ("sched_runtime", ctypes.c_uint64),
        ("sched_deadline", ctypes.c_uint64),
        ("sched_period", ctypes.c_uint64),
    ]


def _load_syscall() -> Any:
    if _NUMBERS is None:
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_long
    return function


_syscall = _load_syscall()
# Per thread: ``depth``, the offloaded calls it awaits with the short slice, and ``before``,
# the slice it had (ns).
_state = threading.local()
# The slices this module gave (ns): a thread started meanwhile inherits one (the kernel
# copies the parent's), which an engine thread gives up (``drop_inherited_slice``).
_shortened: set[int] = set()


def get_slice_ns(tid: int = 0) -> int | None:
    """The scheduler slice of thread ``tid`` (0: the caller) in nanoseconds, or None where
    it cannot be read (not Linux) or the thread is not ``SCHED_OTHER``."""
    if _syscall is None or _NUMBERS is None:
        return None
    attr = _SchedAttr()
    if _syscall(_NUMBERS[1], tid, ctypes.byref(attr), ctypes.sizeof(attr), 0) != 0:
        return None
    if attr.sched_policy != _SCHED_OTHER:
        return None
    return int(attr.sched_runtime)


def _set_slice_ns(nanoseconds: int) -> bool:
    if _syscall is None or _NUMBERS is None:
        return False
    attr = _SchedAttr(
        size=ctypes.sizeof(_SchedAttr),
        sched_policy=_SCHED_OTHER,
        sched_nice=os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
        sched_runtime=nanoseconds,
    )
    return bool(_syscall(_NUMBERS[0], 0, ctypes.byref(attr), 0) == 0)


def enter_short_slice(seconds: float) -> bool:
    """While the calling thread awaits offloaded work, give it a slice of ``seconds``.

    Nested calls on one thread count: the first sets the slice, unless the thread is not
    ``SCHED_OTHER`` or its slice is already at most ``seconds`` (then it is left alone), and
    the matching last :func:`leave_short_slice` puts back the slice it had. Returns whether
    the caller must call :func:`leave_short_slice`.
    """
    if seconds <= 0 or _syscall is None:
        return False
    depth = getattr(_state, "depth", 0)
    if depth == 0:
        wanted = round(seconds * 1e9)
        before = get_slice_ns()
        if before is None or before <= wanted:
            return False
        try:
            if not _set_slice_ns(wanted):
                return False
        except OSError:
            return False
        _state.before = before
        _shortened.add(wanted)
    _state.depth = depth + 1
    return True


def leave_short_slice() -> None:
    """Undo one :func:`enter_short_slice` that returned True (see there)."""
    depth = _state.depth - 1
    _state.depth = depth
    if depth == 0:
        with contextlib.suppress(OSError):
            _set_slice_ns(_state.before)


def drop_inherited_slice() -> None:
    """On a new engine thread: if it inherited a short slice from a thread awaiting an
    ``offload`` (its parent), take the kernel's default instead (a computing thread)."""
    if _shortened and get_slice_ns() in _shortened:
        with contextlib.suppress(OSError):
            _set_slice_ns(0)
