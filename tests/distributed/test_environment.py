"""Workers started from the standard variables, without ``aioautograd.distributed.run``:
set by hand (as a cluster job script or a Kubernetes job would), and by torchrun."""

from __future__ import annotations

import ipaddress
import os
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aioautograd.distributed import rpc
from aioautograd.distributed.rpc.backends.grpc import _outward_address
from tests.distributed.conftest import REPO, free_port

pytestmark = pytest.mark.timeout(90)

SCRIPT = textwrap.dedent(
    """
    import asyncio, os
    import aioautograd as ag
    from aioautograd.distributed import rpc

    @rpc.register
    def square(x):
        return x * x

    async def main():
        rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
        agent = await rpc.init_rpc(f"worker{rank}")
        if agent.info.id == 0:
            result = await rpc.rpc_async("worker1", square, args=(ag.tensor([3.0]),))
            print("result", result.tolist(), flush=True)
        print("backend", agent.backend, "rank", agent.info.id, "of", agent.world_size, flush=True)
        await rpc.shutdown()

    asyncio.run(main())
    """
)


def _clean_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for key in list(env):
        if key.startswith(("AIOAUTOGRAD_", "SLURM_", "TORCHELASTIC_")) or key in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
        ):
            del env[key]
    return env


@pytest.mark.parametrize("style", ["torch", "slurm"])
def test_two_ranks_started_by_hand(tmp_path: Path, style: str) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    common = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "AIOAUTOGRAD_RPC_TOKEN": secrets.token_hex(16),
    }
    procs = []
    try:
        for rank in (1, 0):  # the order does not matter
            if style == "torch":
                ranks = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
            else:
                ranks = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script)],
                    env={**_clean_env(), **common, **ranks},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        outputs = [proc.communicate(timeout=60)[0] for proc in procs]
        assert [proc.returncode for proc in procs] == [0, 0], outputs
        worker1, worker0 = outputs
        assert "result [9.0]" in worker0
        assert "backend grpc rank 0 of 2" in worker0
        assert "backend grpc rank 1 of 2" in worker1
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_torchrun_starts_a_world(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed.run")
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-port", str(free_port()), str(script)]
    env = {**_clean_env(), "AIOAUTOGRAD_RPC_TOKEN": secrets.token_hex(16)}
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=80, check=False, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "result [9.0]" in done.stdout
    assert "backend grpc rank 1 of 2" in done.stdout


def test_hosts_for_several_machines(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("AIOAUTOGRAD_HOST", "AIOAUTOGRAD_MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "10.20.30.40")
    monkeypatch.setenv("MASTER_PORT", "29500")
    resolved = rpc.GrpcOptions(token="t").resolved()
    # Not loopback: no single host fits every rank; each one decides when it starts.
    assert (resolved.master_addr, resolved.master_port, resolved.host) == (
        "10.20.30.40",
        29500,
        None,
    )
    ipaddress.ip_address(_outward_address("10.20.30.40"))  # an address of this machine
    monkeypatch.setenv("AIOAUTOGRAD_MASTER_PORT", "29600")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert rpc.GrpcOptions(token="t").resolved().master_port == 29600
    monkeypatch.delenv("AIOAUTOGRAD_MASTER_PORT")
    under_torchrun = rpc.GrpcOptions(token="t").resolved()
    assert (under_torchrun.master_port, under_torchrun.torchelastic_store) == (
        0,
        ("10.20.30.40", 29500),
    )
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    assert rpc.GrpcOptions(token="t").resolved().host == "127.0.0.1"


def test_a_token_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIOAUTOGRAD_RPC_TOKEN", raising=False)
    secret = tmp_path / "token"
    secret.write_text("s3cret\n")
    monkeypatch.setenv("AIOAUTOGRAD_RPC_TOKEN_FILE", str(secret))
    assert rpc.GrpcOptions(master_port=1).resolved().token == "s3cret"
