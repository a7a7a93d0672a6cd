"""``python -m aioautograd.distributed.run``: environment, prefixed output, failure handling."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.distributed.conftest import REPO

pytestmark = pytest.mark.timeout(60)

SCRIPT = textwrap.dedent(
    """
    import asyncio, os, sys, time
    import aioautograd as ag
    from aioautograd.distributed import rpc

    @rpc.register
    def square(x):
        return x * x

    async def main():
        rank = int(os.environ["RANK"])
        if sys.argv[1:] == ["fail"]:
            if rank == 1:
                sys.exit(3)
            time.sleep(60)  # must be stopped by the launcher
        if sys.argv[1:] == ["pid"]:
            print("pid", os.getpid(), flush=True)
            time.sleep(60)  # until the kernel kills it with the launcher
        if sys.argv[1:] == ["long"]:
            sys.stdout.write("x" * (17 << 20))  # one 17 MB line, no newline at the end
            sys.stdout.flush()
            sys.stderr.write("line\\r\\n" + "y" * 100_000 + "\\nlast")
            return
        await rpc.init_rpc(f"worker{rank}")  # everything else comes from the environment
        if rank == 0:
            result = await rpc.rpc_async("worker1", square, args=(ag.tensor([3.0]),))
            print("result", result.tolist())
        print("backend", rpc.get_current_agent().backend, "world", os.environ["WORLD_SIZE"])
        await rpc.shutdown()

    asyncio.run(main())
    """
)


def _launch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "aioautograd.distributed.run", "--nproc", "2"]
    command += ["--kill-timeout", "2", str(script), *args]
    return subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=50, check=False
    )


def test_launcher_runs_a_world(tmp_path: Path) -> None:
    done = _launch(tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "[rank 0] result [9.0]" in lines
    assert "[rank 0] backend grpc world 2" in lines
    assert "[rank 1] backend grpc world 2" in lines


def test_launcher_stops_everyone_when_one_fails(tmp_path: Path) -> None:
    done = _launch(tmp_path, "fail")
    assert done.returncode == 3
    assert "[launcher] rank 1 exited with code 3; stopping the others" in done.stderr


def _run(*command: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *command],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
        env=env,
    )


def test_module_name_without_dash_m_says_to_add_it() -> None:
    done = _run(
        "-m", "aioautograd.distributed.run", "--nproc", "2", "aioautograd.examples.model_parallel"
    )
    assert done.returncode == 2
    assert "-m aioautograd.examples.model_parallel" in done.stderr
    assert "can't open file" not in done.stderr
    assert "[rank" not in done.stdout + done.stderr  # nothing was started


def test_missing_script_is_refused_before_starting(tmp_path: Path) -> None:
    done = _run("-m", "aioautograd.distributed.run", "--nproc", "2", str(tmp_path / "nope.py"))
    assert done.returncode == 2
    assert "no file" in done.stderr
    assert "[rank" not in done.stdout + done.stderr


def test_launcher_refuses_the_single_process_backend() -> None:
    done = _run(
        "-m", "aioautograd.distributed.run", "--nproc", "2", "--backend", "local", "-m", "x"
    )
    assert done.returncode == 2
    assert "invalid choice: 'local'" in done.stderr


def test_example_grpc_without_the_launcher_says_how_to_launch() -> None:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = _run("-m", "aioautograd.examples.model_parallel", "--backend", "grpc", env=env)
    assert done.returncode == 2
    assert "KeyError" not in done.stderr
    assert "python -m aioautograd.distributed.run --nproc 2 -m" in done.stderr


def test_example_local_backend_under_the_launcher_is_an_error_not_two_copies() -> None:
    done = _run(
        "-m",
        "aioautograd.distributed.run",
        "--nproc",
        "2",
        "--kill-timeout",
        "2",
        "-m",
        "aioautograd.examples.model_parallel",
        "--backend",
        "local",
        "--steps",
        "2",
    )
    assert done.returncode != 0
    assert "each would train its own copy" in done.stderr
    assert "final loss" not in done.stdout


def test_launcher_relays_lines_of_any_length(tmp_path: Path) -> None:
    done = _launch(tmp_path, "long")
    assert done.returncode == 0, done.stderr[-2000:]
    # 17 MB lines without a newline come as 17 prefixed lines of 1 MiB per rank.
    lines = done.stdout.splitlines()
    for rank in (0, 1):
        assert lines.count(f"[rank {rank}] " + "x" * (1 << 20)) == 17
    assert len(lines) == 34
    for rank in (0, 1):
        for text in ("line", "y" * 100_000, "last"):  # text mode reads \r\n as \n
            assert f"[rank {rank}] {text}" in done.stderr.split("\n")


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_ranks_die_with_a_killed_launcher(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "aioautograd.distributed.run", "--nproc", "2"]
    launcher = subprocess.Popen(
        [*command, str(script), "pid"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    pids: list[int] = []
    try:
        assert launcher.stdout is not None
        pids = [int(launcher.stdout.readline().split()[-1]) for _ in range(2)]
        launcher.kill()  # no handler runs: only the kernel can stop the ranks now
        launcher.wait(10)
        deadline = time.monotonic() + 10
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [pid for pid in pids if _alive(pid)]
            time.sleep(0.05)
        assert alive == []
    finally:
        launcher.kill()
        launcher.wait(10)
        if launcher.stdout is not None:
            launcher.stdout.close()
        for pid in pids:  # if the test failed: leave nothing behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (dead, not yet reaped by init) counts as dead
    with contextlib.suppress(FileNotFoundError):
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    return False
