"""Keeping a worker's core awake between messages (``GrpcOptions.keep_awake_s``, Linux).

On a virtual machine, a vCPU with nothing to run halts, and the host may lend its physical
core to someone else; waking it for the next message then waits for the host (counted by
the guest as steal time) and resumes on cold caches. Two workers that call each other on
one host halt and wake several times per round trip: on the 2-vCPU VM of
``benchmarks/README.md`` (issue #15, branch ``s30-m15``) the model-parallel step's slow
runs (median ~10 ms instead of ~6) were the runs whose host stole most, and they
disappeared when both vCPUs were kept from idling while the machine was otherwise quiet.
(``torch.distributed.rpc``'s TensorPipe transport busy-polls on one host, which keeps its
cores awake at a cost of about two cores.)

:class:`CoreWaker` starts a small helper process at the lowest CPU priority
(``SCHED_IDLE``: it runs when a core has nothing else to run, and any other runnable
process preempts it, so it takes next to no CPU time from this worker, its peers or anyone)
that spins while this worker has sent or received a frame within the last ``hold_s``
seconds and sleeps, blocked on a pipe, otherwise: an idle world costs no CPU. The worker
marks its activity with :meth:`CoreWaker.stamp` (a store into shared memory; a pipe write
only when the helper sleeps). The helper exits when the worker closes its end of the pipe,
or dies.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import subprocess
import sys
import time

__all__ = ["CoreWaker", "supported"]

_STAMP = struct.Struct("d")
_ASLEEP = _STAMP.size  # the byte the helper sets before it blocks on the pipe
_SIZE = _ASLEEP + 1

# The helper (run with ``python -I -S``: the standard library only). Spins in slices of
# ~20-50 µs while the last stamp is younger than the hold; otherwise marks itself asleep,
# checks the stamp once more (a stamp written in between would find the mark set and
# write to the pipe, or be seen here) and blocks on the pipe.
_HELPER = f"""
import mmap, os, struct, sys, time
shared_fd, wake_fd, hold = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
shared = mmap.mmap(shared_fd, {_SIZE})
unpack = struct.Struct("d").unpack_from
monotonic = time.monotonic
while True:
    if monotonic() - unpack(shared, 0)[0] < hold:
        for _ in range(500):
            pass
        continue
    shared[{_ASLEEP}] = 1
    if monotonic() - unpack(shared, 0)[0] < hold:
        shared[{_ASLEEP}] = 0
        continue
    if not os.read(wake_fd, 4096):
        break
    shared[{_ASLEEP}] = 0
"""


def supported() -> bool:
    """Whether this platform can run the helper (Linux: ``memfd_create``, ``SCHED_IDLE``)."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create")


class CoreWaker:
    """A helper process that keeps one core from idling while this worker exchanges frames.

    Args:
        hold_s: How long after the last :meth:`stamp` the helper keeps spinning.

    Raises:
        ValueError: ``hold_s`` is not positive.
        OSError: the platform cannot run it (see :func:`supported`), or the helper could
            not be started.
    """

    def __init__(self, hold_s: float) -> None:
        if not hold_s > 0:
            raise ValueError(f"the hold must be positive, got {hold_s!r}")
        if not supported():
            raise OSError("keeping cores awake needs Linux (memfd_create, SCHED_IDLE)")
        self.hold_s = float(hold_s)
        shared_fd = os.memfd_create("aioautograd-awake", os.MFD_CLOEXEC)
        read_fd = write_fd = -1
        try:
            os.ftruncate(shared_fd, _SIZE)
            self._shared = mmap.mmap(shared_fd, _SIZE)
            read_fd, write_fd = os.pipe()
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    "-c",
                    _HELPER,
                    str(shared_fd),
                    str(read_fd),
                    repr(self.hold_s),
                ],
                pass_fds=(shared_fd, read_fd),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
        except BaseException:
            if write_fd >= 0:
                os.close(write_fd)
            raise
        finally:
            os.close(shared_fd)
            if read_fd >= 0:
                os.close(read_fd)
        try:  # set by the worker at once, not by the helper's own (later) code
            os.sched_setscheduler(self.process.pid, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, self.process.pid, 19)
        os.set_blocking(write_fd, False)
        self._wake_fd: int | None = write_fd
        self._pack = _STAMP.pack_into
        self._monotonic = time.monotonic

    def stamp(self) -> None:
        """Mark activity now: the helper spins for the next ``hold_s`` seconds."""
        shared = self._shared
        self._pack(shared, 0, self._monotonic())
        if shared[_ASLEEP] and self._wake_fd is not None:
            shared[_ASLEEP] = 0
            with contextlib.suppress(BlockingIOError):  # a full pipe wakes it as well
                os.write(self._wake_fd, b"\0")

    def close(self, timeout: float = 2.0) -> None:
        """Stop the helper (it exits when the pipe closes) and wait for it. A later
        :meth:`stamp` does nothing."""
        if self._wake_fd is None:
            return
        os.close(self._wake_fd)
        self._wake_fd = None
        # Let a spinning helper see the hold over at once.
        self._pack(self._shared, 0, float("-inf"))
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
