"""Devices: where tensors live and which array module computes on them."""

from aioautograd.devices.device import Device, device

__all__ = ["Device", "device"]
