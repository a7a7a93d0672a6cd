"""A simulated accelerator for tests: ``sim:0`` .. ``sim:3``.

Arrays are NumPy arrays, so results are exact; what is simulated is the *ordering
protocol*: every stream records, waits and uses are appended to :data:`LOG`, so a test can
check that each consumer waited on its producer's event before using a gradient. Each
``sim`` device gets its own executor thread in the engine, like a CUDA device.

This is a test backend, not a real one: it gives no speed and no concurrency of its own.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from aioautograd.devices.device import Backend, Device
from aioautograd.devices.streams import Event, Stream

NUM_DEVICES = 4


@dataclass(frozen=True, slots=True)
class SimOp:
    """One logged operation: ``kind`` is ``record``, ``wait``, ``use`` or ``sync``."""

    kind: str
    stream: str
    event: int | None
    label: str
    thread: str


class _Log:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ops: list[SimOp] = []

    def add(self, kind: str, stream: str, event: int | None = None, label: str = "") -> None:
        op = SimOp(kind, stream, event, label, threading.current_thread().name)
        with self._lock:
            self.ops.append(op)

    def clear(self) -> None:
        with self._lock:
            self.ops.clear()

    def snapshot(self) -> list[SimOp]:
        with self._lock:
            return list(self.ops)


LOG = _Log()
_event_ids = itertools.count(1)
_stream_ids = itertools.count(1)


class SimEvent(Event):
    def __init__(self, stream: SimStream) -> None:
        self.id = next(_event_ids)
        self.device = stream.device
        self.stream = stream
        self.waited = False

    def synchronize(self) -> None:
        LOG.add("sync", self.stream.name, self.id)
        self.waited = True

    def query(self) -> bool:
        # Done only once waited for: the engine then takes the path of a busy GPU (a thread
        # synchronizes), and that wait shows in the log.
        return self.waited

    def __repr__(self) -> str:
        return f"<SimEvent {self.id} on {self.stream.name}>"


class SimStream(Stream):
    def __init__(self, device: Device, name: str) -> None:
        self.device = device
        self.name = name

    def record_event(self) -> SimEvent:
        event = SimEvent(self)
        LOG.add("record", self.name, event.id)
        return event

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, SimEvent)
        LOG.add("wait", self.name, event.id)

    def synchronize(self) -> None:
        LOG.add("sync", self.name)

    def __repr__(self) -> str:
        return f"<SimStream {self.name}>"


class SimulatedBackend(Backend):
    xp = np
    has_streams = True

    def __init__(self) -> None:
        self._defaults: dict[int, SimStream] = {}
        self._lock = threading.Lock()
        self._current: ContextVar[Mapping[int, SimStream]] = ContextVar(
            "sim_streams", default=MappingProxyType({})
        )

    def check(self, index: int | None) -> None:
        if index is None or not 0 <= index < NUM_DEVICES:
            raise RuntimeError(
                f"invalid device sim:{index}: the simulated backend has {NUM_DEVICES} devices"
            )

    def default_stream(self, index: int) -> SimStream:
        stream = self._defaults.get(index)
        if stream is None:
            with self._lock:
                stream = self._defaults.get(index)
                if stream is None:
                    stream = SimStream(Device("sim", index), f"sim:{index}/default")
                    self._defaults[index] = stream
        return stream

    def current_stream(self, index: int | None) -> SimStream:
        assert index is not None
        return self._current.get().get(index) or self.default_stream(index)

    def new_stream(self, index: int | None) -> SimStream:
        assert index is not None
        return SimStream(Device("sim", index), f"sim:{index}/s{next(_stream_ids)}")

    @contextlib.contextmanager
    def use_stream(self, stream: Stream | None, label: str = "") -> Iterator[None]:
        if stream is None:
            yield
            return
        assert isinstance(stream, SimStream)
        index = stream.device.index
        assert index is not None
        LOG.add("use", stream.name, None, label)
        token = self._current.set({**self._current.get(), index: stream})
        try:
            yield
        finally:
            self._current.reset(token)

    def to_host(self, array: Any) -> np.ndarray[Any, Any]:
        return np.asarray(array)

    def from_host(self, array: np.ndarray[Any, Any], index: int | None) -> Any:
        return np.array(array, copy=True)


BACKEND = SimulatedBackend()
