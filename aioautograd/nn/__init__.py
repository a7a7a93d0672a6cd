"""Neural-network building blocks."""

from aioautograd.nn import functional

__all__ = ["functional"]
