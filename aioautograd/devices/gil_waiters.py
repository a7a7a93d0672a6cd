"""Whether another Python thread may be waiting for the GIL or for a core (the worker's pause).

A worker that runs many small nodes holds the GIL between NumPy calls that never release it,
so it pauses every ``gil_hold_s`` to let the event loop's thread in (``executor.pause_if_due``).
A pause is a sleep: asked for 20 µs, it took about 100 µs on the benchmarks' VM (timer slack),
and under load the kernel gave the core to another process for up to a time slice. When no
other thread wants the GIL (the loop waits in ``epoll_wait`` for the backward to finish, the
usual case) that is pure loss: a 10,000-node chain paused about 50 times per backward,
7-25% of its time.

So the worker first looks at what the process's other Python threads are doing, in the
kernel's ``/proc/self/task/<tid>/wchan`` (Linux): a thread asleep in an I/O wait (``epoll``,
``poll``, ``select``, ``nanosleep``, a pipe or socket read) does not need the GIL, and the
pause is skipped. A thread that is runnable (``0``: woken, waiting for the GIL's mutex or
for a core) or asleep on a futex (the GIL's condition, or a lock: it may be what the thread
waits for) gets the pause, as does any thread whose state cannot be read. The engine's own
threads (workers, intra-op helpers, the watchdog) are not asked for: they share the GIL by
CPython's switch interval, as before the pauses existed. The look costs a few microseconds
per thread, once per ``gil_hold_s``, for at most ``_MAX_PROBES`` threads (with more, every due
pause is taken); elsewhere than Linux every due pause is taken.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

# The engine's own threads (native ids): never a reason to pause.
_engine_threads: set[int] = set()
# Open ``wchan`` files of the other threads, by native id (read again with pread).
_wchan_files: dict[int, int] = {}
_files_lock = threading.Lock()
_SUPPORTED = sys.platform.startswith("linux") and os.path.exists("/proc/self/task")
# More Python threads than this besides the engine's (a large thread pool): pause, as before
# the check existed, rather than read each one's state every ``gil_hold_s``.
_MAX_PROBES = 8


def _forget_all() -> None:
    # A forked child has none of its parent's threads: their ids and open files mean nothing.
    _engine_threads.clear()
    for fd in _wchan_files.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _wchan_files.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_all)


def register_engine_thread() -> None:
    """Mark the calling thread as one of the engine's (it never asks a worker to pause)."""
    _engine_threads.add(threading.get_native_id())


def forget_engine_thread() -> None:
    """Undo :func:`register_engine_thread` (the calling thread is about to exit)."""
    _engine_threads.discard(threading.get_native_id())


def others_may_wait() -> bool:
    """Whether a Python thread other than the caller and the engine's may be waiting for the
    GIL or for a core (see the module docstring); True whenever that cannot be told."""
    if not _SUPPORTED:
        return True
    me = threading.get_native_id()
    engine = _engine_threads
    threads = threading.enumerate()
    if _wchan_files:
        alive = {thread.native_id for thread in threads}
        if not alive.issuperset(_wchan_files):  # some have exited: close their files
            for gone in [tid for tid in _wchan_files if tid not in alive]:
                _close(gone)
    probes = _MAX_PROBES
    for thread in threads:
        native_id = thread.native_id
        if native_id is None or native_id == me or native_id in engine:
            continue
        if not probes or thread_may_wait(native_id):
            return True
        probes -= 1
    return False


def thread_may_wait(tid: int) -> bool:
    """Whether the thread with native id ``tid`` (of this process) may be waiting for the
    GIL or a core: runnable, or asleep on a futex, or its state unreadable (Linux)."""
    if not _SUPPORTED:
        return True
    fd = _wchan_files.get(tid)
    try:
        if fd is None:
            fd = os.open(f"/proc/self/task/{tid}/wchan", os.O_RDONLY | os.O_CLOEXEC)
            with _files_lock:
                previous = _wchan_files.get(tid)
                _wchan_files[tid] = fd
            if previous is not None:  # another worker opened it meanwhile
                os.close(previous)
        channel = os.pread(fd, 64, 0)
    except OSError:
        # The thread has exited (its native id may come back for a new thread: reopen), or
        # the file cannot be read here: pause, as when nothing can be told.
        _close(tid)
        return True
    return channel == b"0" or b"futex" in channel or not channel


def _close(tid: int) -> None:
    with _files_lock:
        fd = _wchan_files.pop(tid, None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
