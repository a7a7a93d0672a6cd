"""``GrpcOptions.keep_freed_memory``: a grpc worker process reuses freed memory instead of
faulting it back in (``tests/devices/test_memory.py`` tests the setting itself)."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import pytest

from aioautograd.distributed import rpc
from tests.distributed import hardening_fns
from tests.distributed.conftest import in_fresh_context, start_world

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
        reason="glibc's malloc thresholds",
    ),
]


@pytest.mark.parametrize("keep", [True, False])
async def test_grpc_worker_processes_keep_freed_memory_unless_told_not_to(
    tmp_path: Path, keep: bool
) -> None:
    await in_fresh_context(lambda: _grpc_worker_faults(tmp_path, keep))


async def _grpc_worker_faults(tmp_path: Path, keep: bool) -> None:
    options = None if keep else {"keep_freed_memory": False}
    world = await start_world("grpc", tmp_path, n_workers=1, grpc_options=options)
    try:
        faults = await rpc.rpc_async("worker1", hardening_fns.freed_memory_faults)
        if keep:
            assert faults < 50
        else:
            assert faults > 1000
        assert await world.close() == {"worker1": 0}
    finally:
        world.kill_all()
