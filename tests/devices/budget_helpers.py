"""Helpers shared by the CPU budget's tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from aioautograd.devices.cpu_budget import CpuBudget


@contextlib.contextmanager
def a_worker_computing(budget: CpuBudget) -> Iterator[None]:
    """A worker thread counted as computing on ``budget`` for the block."""
    with budget._lock:
        budget._count(1)
    try:
        yield
    finally:
        with budget._lock:
            budget._count(-1)
