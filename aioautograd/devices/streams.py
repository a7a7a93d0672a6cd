"""Streams and events: the protocol the engine uses to order work on accelerators.

A stream is a queue of device work; an event marks a point in a stream. The engine keeps
producers and consumers ordered on the device itself: ``consumer.wait_event(
producer.record_event())`` makes the consumer stream wait without blocking the host. CUDA
implements this with CuPy streams and events; the simulated backend logs every record, wait
and use so tests can check the ordering on machines without a GPU.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aioautograd.devices.device import Device


class Event(ABC):
    """A point in a stream's work."""

    device: Device

    @abstractmethod
    def synchronize(self) -> None:
        """Block the calling host thread until the work before the event has finished."""

    @abstractmethod
    def query(self) -> bool:
        """Whether the work before the event has finished."""


class Stream(ABC):
    """An ordered queue of work on one device."""

    device: Device

    @abstractmethod
    def record_event(self) -> Event:
        """Record an event at the current end of this stream."""

    @abstractmethod
    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for ``event`` (on the device, not the host)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the calling host thread until all work on this stream has finished."""

    def wait_stream(self, other: Stream) -> None:
        """Make later work on this stream wait for everything issued to ``other`` so far."""
        if other != self:
            self.wait_event(other.record_event())


def current_stream(device: Device | str) -> Stream | None:
    """The stream work on ``device`` is issued to in this context (``None`` for CPU)."""
    from aioautograd.devices.device import device as as_device

    dev = as_device(device)
    return dev.backend.current_stream(dev.index)


def new_stream(device: Device | str) -> Stream:
    """A new stream on ``device`` (an accelerator)."""
    from aioautograd.devices.device import device as as_device

    dev = as_device(device)
    return dev.backend.new_stream(dev.index)


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[Stream | None]:
    """Issue the work of the block to ``s`` (PyTorch's ``torch.cuda.stream``).

    Autograd remembers, for every node, the stream current at its forward; its backward
    runs on that stream. ``None`` is a no-op.
    """
    if s is None:
        yield None
        return
    with s.device.backend.use_stream(s):
        yield s
