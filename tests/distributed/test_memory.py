"""``keep_freed_memory``: a worker process reuses freed memory instead of faulting it back in
(glibc's mmap and trim thresholds). Each case runs in a fresh process: the setting is
process-wide."""

from __future__ import annotations

import json
import os
import platform
import subprocess
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

# Four 3 MiB blocks allocated and freed, 50 times: with glibc's own thresholds (after the
# first free: mmap 3 MiB, trim 6 MiB) the 12 MiB freed at the top of the heap go back to
# the kernel each time, and their pages fault in again.
_PATTERN = """
import json, resource, sys
from aioautograd.distributed.rpc.memory import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    blocks = [bytearray(3 << 20) for _ in range(4)]
    del blocks
before = faults()
for _ in range(50):
    blocks = [bytearray(3 << 20) for _ in range(4)]
    del blocks
print(json.dumps({"applied": applied, "faults_per_round": (faults() - before) / 50}))
"""


def _run(mode: str, **env: str) -> dict[str, object]:
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("MALLOC_") and key != "GLIBC_TUNABLES"
    }
    environment.update(env)
    environment["PYTHONPATH"] = os.pathsep.join(sys.path)
    done = subprocess.run(
        [sys.executable, "-c", _PATTERN, mode],
        capture_output=True,
        text=True,
        timeout=50,
        env=environment,
        check=True,
    )
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_freed_memory_is_reused_without_page_faults() -> None:
    kept = _run("keep")
    assert kept["applied"] is True
    default = _run("default")
    # 12 MiB are 3,072 pages: faulted in again every round by default, never once kept.
    assert default["faults_per_round"] > 1000  # type: ignore[operator]
    assert kept["faults_per_round"] < 50  # type: ignore[operator]


@pytest.mark.parametrize(
    "env",
    [
        {"MALLOC_TRIM_THRESHOLD_": "131072"},
        {"MALLOC_MMAP_THRESHOLD_": "131072"},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"},
    ],
)
def test_the_environments_own_settings_are_left_alone(env: dict[str, str]) -> None:
    result = _run("keep", **env)
    assert result["applied"] is False
    assert result["faults_per_round"] > 1000  # type: ignore[operator]


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
