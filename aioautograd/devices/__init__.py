"""Devices: where tensors live, which array module computes on them, and their streams."""

from aioautograd.devices.device import Backend, Device, device
from aioautograd.devices.streams import Event, Stream, current_stream, new_stream, stream

__all__ = [
    "Backend",
    "Device",
    "Event",
    "Stream",
    "current_stream",
    "device",
    "new_stream",
    "stream",
]
