"""Functional neural-network ops (``aioautograd.nn.functional``)."""

from __future__ import annotations
