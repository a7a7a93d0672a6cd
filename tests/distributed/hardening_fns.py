"""Remote functions for the hardening tests (registered on import, as worker_main does)."""

from __future__ import annotations

import resource
import time
from pathlib import Path

from aioautograd.distributed import rpc


@rpc.register
async def dead_workers() -> dict[str, str]:
    return rpc.get_current_agent().dead_workers


@rpc.register
async def block_loop(seconds: float) -> str:
    time.sleep(seconds)  # noqa: ASYNC251 (the point: a busy event loop)
    return "done"


@rpc.register
def memory_mb() -> dict[str, float]:
    """Current and peak resident memory of this process (Linux)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields


@rpc.register
def freed_memory_faults() -> float:
    """Page faults per round of allocating and freeing four 3 MiB blocks in this process."""
    for _ in range(3):
        blocks = [bytearray(3 << 20) for _ in range(4)]
        del blocks
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        blocks = [bytearray(3 << 20) for _ in range(4)]
        del blocks
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20
