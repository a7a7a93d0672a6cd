"""OpenBLAS's own thread pool: how long its idle threads spin after a call.

After every multi-threaded call, the threads of OpenBLAS's pthreads pool (the build NumPy's
wheels ship) spin on their queues for 2**28 TSC cycles, about 0.1 s, before they sleep. The
CPU budget keeps BLAS on one thread while aioautograd computes, but the user's own NumPy
products between two training steps still run on the pool, and the spinning thread then
takes a core from the engine's next backward: on 2 cores the ``mlp`` step took 30-36 ms
right after one NumPy product, against 23-25 ms without it, and 24 ms with a short spin.

OpenBLAS reads the spin's length once, from ``OPENBLAS_THREAD_TIMEOUT`` (log2 of the
cycles, 4-30), when its pool starts; NumPy starts it at import, before aioautograd can set
the variable. :func:`shorten_idle_spin` re-reads the variable with a short value and
restarts the pool with it (``blas_thread_shutdown_``; the next call, or the thread count set
right after, starts it again). The results do not change: the thread count, and so the
split of every product between the threads, is the same. The pool is restarted only while
it is idle: BLAS goes to one thread first, so that no new call hands it work, and the
restart waits until every unnamed thread that Python did not start sleeps. When one does
not within ``wait_s`` (a native thread keeps computing), the pool is left as it was.

A timeout set in the environment (``OPENBLAS_THREAD_TIMEOUT`` or ``GOTO_THREAD_TIMEOUT``) is
kept, and ``EnginePolicy(manage_blas_threads=False)`` leaves BLAS alone altogether.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

SPIN_LOG2_CYCLES = 20
"""The idle spin this module sets: 2**20 cycles, about 0.4 ms at 2.5 GHz (OpenBLAS: 2**28).
Back-to-back calls still find the pool awake; NumPy's ``mlp`` step was as fast as with the
default (18.6-20.3 ms against 19.8-20.5 ms)."""

_ENV = "OPENBLAS_THREAD_TIMEOUT"
_outcomes: dict[str, str] = {}  # by library path: what shorten_idle_spin did
_lock = threading.Lock()


def shorten_idle_spin(
    dynlib: Any,
    get_threads: Callable[[], int],
    set_threads: Callable[[int], Any],
    wait_s: float = 0.25,
) -> str:
    """Restart the OpenBLAS pool of ``dynlib`` (a ``ctypes`` handle) with a short idle spin,
    once per library and process; ``get_threads``/``set_threads`` read and set its thread
    count. Returns what was done, then and on every later call:

    - ``"shortened"``: the pool now sleeps ``2**SPIN_LOG2_CYCLES`` cycles after a call;
    - ``"configured"``: a timeout is set in the environment (the user's to decide);
    - ``"busy"``: a native thread kept running for ``wait_s``; the pool was left alone;
    - ``"unsupported"``: not Linux, or a build without these entry points.
    """
    name = str(getattr(dynlib, "_name", id(dynlib)))
    with _lock:
        outcome = _outcomes.get(name)
        if outcome is None:
            outcome = _outcomes[name] = _shorten(dynlib, get_threads, set_threads, wait_s)
        return outcome


def openblas_symbol(dynlib: Any, name: str) -> Any:
    """OpenBLAS's entry point ``name`` in ``dynlib``, or None. NumPy's wheels export most with
    a ``scipy_`` prefix and a ``64_`` suffix, and the pool's internals
    (``blas_thread_shutdown_``, ``openblas_read_env``) without."""
    for prefix in ("", "scipy_"):
        for suffix in ("", "64_", "_64"):
            function = getattr(dynlib, prefix + name + suffix, None)
            if function is not None:
                return function
    return None


def _shorten(
    dynlib: Any, get_threads: Callable[[], int], set_threads: Callable[[int], Any], wait_s: float
) -> str:
    timeout = openblas_symbol(dynlib, "openblas_thread_timeout")
    read_env = openblas_symbol(dynlib, "openblas_read_env")
    shutdown = openblas_symbol(dynlib, "blas_thread_shutdown_")
    if not sys.platform.startswith("linux") or None in (timeout, read_env, shutdown):
        return "unsupported"
    if int(timeout()) > 0 or any(os.environ.get(name) for name in (_ENV, "GOTO_THREAD_TIMEOUT")):
        return "configured"
    os.environ[_ENV] = str(SPIN_LOG2_CYCLES)
    try:
        read_env()  # the pool takes the timeout from here when it starts
    finally:
        del os.environ[_ENV]  # child processes start with NumPy's default, as before
    threads = get_threads()
    set_threads(1)  # from here on no call hands the pool work
    try:
        # A call that chose its thread count just before has queued its jobs by now; then
        # the pool is idle once its threads sleep (a thread that runs a job does not).
        time.sleep(0.001)
        if not _native_threads_sleep(time.perf_counter() + wait_s):
            return "busy"
        shutdown()
    finally:
        set_threads(threads)  # starts the pool again, with the short spin
    return "shortened"


def _native_threads_sleep(deadline: float) -> bool:
    """Wait until every unnamed thread of this process that Python did not start (OpenBLAS
    names none of its threads; gRPC's and ZeroMQ's have names) is off the CPU (``/proc``: not
    ``R``), until ``deadline``; whether they are."""
    try:
        with open("/proc/self/comm") as comm:
            unnamed = comm.read()  # a thread nobody named has its creator's, the process's
    except OSError:
        return False
    while True:
        started = {thread.native_id for thread in threading.enumerate()}
        tasks = [tid for tid in os.listdir("/proc/self/task") if int(tid) not in started]
        if not any(_runs_unnamed(tid, unnamed) for tid in tasks):
            return True
        if time.perf_counter() >= deadline:
            return False
        time.sleep(0.002)


def _runs_unnamed(tid: str, unnamed: str) -> bool:
    """Whether thread ``tid`` of this process has the name ``unnamed`` and is on a CPU."""
    try:
        with open(f"/proc/self/task/{tid}/comm") as comm:
            if comm.read() != unnamed:
                return False
        with open(f"/proc/self/task/{tid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "R"
    except (OSError, IndexError):
        return False  # the thread ended meanwhile
