"""``keep_freed_memory``: a process reuses freed memory instead of faulting it back in
(glibc's mmap and trim thresholds), and the engine's policy applies it. Each case runs in a
fresh process: the setting is process-wide."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from aioautograd.engine import EnginePolicy

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
        reason="glibc's malloc thresholds",
    ),
]

# How the process is set up (argv[1]), then four 3 MiB blocks allocated and freed, 50 times:
# with glibc's own thresholds (after the first free: mmap 3 MiB, trim 6 MiB) the 12 MiB
# freed at the top of the heap go back to the kernel each time, and their pages fault in
# again.
_PATTERN = """
import json, resource, sys
applied = None
if sys.argv[1] == "keep":
    from aioautograd.devices.memory import keep_freed_memory
    applied = keep_freed_memory()
elif sys.argv[1].startswith("engine"):
    import aioautograd as ag
    if sys.argv[1] == "engine-off":
        ag.set_default_engine(ag.Engine(ag.EnginePolicy(keep_freed_memory=False)))
    x = ag.randn(64, 64, requires_grad=True)
    ag.backward_sync((x @ x).sum())  # the first product configures the CPU budget
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


def test_the_engine_keeps_freed_memory_once_it_computes() -> None:
    assert EnginePolicy().keep_freed_memory is True
    result = _run("engine")
    assert result["faults_per_round"] < 50  # type: ignore[operator]


def test_a_policy_that_says_no_leaves_malloc_alone() -> None:
    result = _run("engine-off")
    assert result["faults_per_round"] > 1000  # type: ignore[operator]


def test_the_engine_leaves_the_environments_settings_alone() -> None:
    result = _run("engine", MALLOC_TRIM_THRESHOLD_="131072")
    assert result["faults_per_round"] > 1000  # type: ignore[operator]
