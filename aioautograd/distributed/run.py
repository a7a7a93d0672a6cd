"""Launch a world of worker processes: ``python -m aioautograd.distributed.run``.

Usage::

    python -m aioautograd.distributed.run --nproc 2 train.py --epochs 3
    python -m aioautograd.distributed.run --nproc 4 -m mypackage.train

The launcher's own options come before the script (or ``-m module``); everything after it
is the script's. A script that is not a file, or a module name without ``-m``, is refused
with a message.

Starts ``--nproc`` processes of the script (or module), each with ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``AIOAUTOGRAD_RPC_TOKEN`` (a fresh random
token unless one is set already) and ``AIOAUTOGRAD_RPC_BACKEND=grpc`` in the environment, so
that ``await rpc.init_rpc(f"worker{rank}")`` needs no other argument. Their standard output
and error are streamed line by line with a ``[rank N]`` prefix. If one process fails (exits
with a non-zero code or is killed), the others are terminated (SIGTERM, then SIGKILL after
``--kill-timeout`` seconds) and the launcher exits with the failed process's code; it exits
with 0 when all processes do. Ctrl-C stops them all.

Only local processes are started. For several machines, start each worker with the same
variables set by hand or by torchrun, SLURM or a Kubernetes job (the same token, rank 0's
address as ``MASTER_ADDR``; see the README). Output lines longer than 1 MiB are relayed as
several lines; if the launcher itself fails, it stops every rank before it exits, and on
Linux a rank is killed by the kernel if the launcher dies without a chance to (SIGKILL).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import importlib.util
import os
import secrets
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from typing import BinaryIO

_PR_SET_PDEATHSIG = 1
_LINE_PIECE = 1 << 20  # longer output lines are relayed as several lines of this size


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m aioautograd.distributed.run",
        description="Start N local worker processes of an aioautograd RPC world.",
    )
    parser.add_argument("--nproc", type=int, required=True, help="number of processes")
    parser.add_argument("--master-addr", default="127.0.0.1", help="rank 0's address")
    parser.add_argument("--master-port", type=int, default=0, help="rank 0's port (0: free)")
    parser.add_argument(
        "--backend",
        default="grpc",
        choices=["grpc"],
        help="AIOAUTOGRAD_RPC_BACKEND to set (grpc: the backend that spans processes)",
    )
    parser.add_argument(
        "--kill-timeout",
        type=float,
        default=5.0,
        help="seconds between SIGTERM and SIGKILL when stopping the processes",
    )
    parser.add_argument("-m", dest="module", action="store_true", help="run a module")
    parser.add_argument("script", help="the script (or, with -m, the module) to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error("--nproc must be at least 1")
    if not args.module and not os.path.isfile(args.script):
        parser.error(_missing_script(args.script))
    return args


def _missing_script(script: str) -> str:
    if not script.endswith(".py") and "/" not in script and os.sep not in script:
        with contextlib.suppress(ImportError, ValueError):
            if importlib.util.find_spec(script) is not None:
                return (
                    f"no file {script!r}; {script} is a module: run it with -m, as in "
                    f"python -m aioautograd.distributed.run --nproc N -m {script} [args]"
                )
    return f"no file {script!r} (a module name needs -m before it)"


class _Launcher:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.procs: list[asyncio.subprocess.Process] = []
        self.stopping = False
        self.signal_tasks: set[asyncio.Task[None]] = set()

    def _env(self, rank: int, port: int, token: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(self.args.nproc),
            LOCAL_WORLD_SIZE=str(self.args.nproc),
            MASTER_ADDR=self.args.master_addr,
            MASTER_PORT=str(port),
            AIOAUTOGRAD_RPC_TOKEN=token,
            AIOAUTOGRAD_RPC_BACKEND=self.args.backend,
            PYTHONUNBUFFERED="1",
        )
        return env

    async def run(self) -> int:
        args = self.args
        port = args.master_port or _free_port(args.master_addr)
        token = os.environ.get("AIOAUTOGRAD_RPC_TOKEN") or secrets.token_urlsafe(32)
        command = [sys.executable, *(["-m"] if args.module else []), args.script, *args.args]
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        failure = 0
        die_with_parent = _die_with_parent_hook()
        try:
            async with asyncio.TaskGroup() as group:
                for rank in range(args.nproc):
                    proc = await asyncio.create_subprocess_exec(
                        *command,
                        env=self._env(rank, port, token),
                        stdin=asyncio.subprocess.DEVNULL,
                        stdout=asyncio.subprocess.PIPE,
                        stderr=asyncio.subprocess.PIPE,
                        start_new_session=True,  # so that stopping reaches its children too
                        preexec_fn=die_with_parent,
                    )
                    self.procs.append(proc)
                    assert proc.stdout is not None
                    assert proc.stderr is not None
                    group.create_task(_pump(proc.stdout, sys.stdout.buffer, rank))
                    group.create_task(_pump(proc.stderr, sys.stderr.buffer, rank))
                waiters = [_exit_of(rank, proc) for rank, proc in enumerate(self.procs)]
                for finished in asyncio.as_completed(waiters):
                    rank, code = await finished
                    if code != 0 and not failure:
                        failure = code if code > 0 else 128 - code  # killed by signal -code
                        self._say(f"rank {rank} exited with code {code}; stopping the others")
                        group.create_task(self._stop_all())
        except BaseException:
            # Whatever went wrong here, no rank is left running without its supervisor.
            self._say("the launcher failed; stopping all processes")
            await asyncio.shield(self._stop_all(force=True))
            raise
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        return failure

    def _on_signal(self, sig: signal.Signals) -> None:
        self._say(f"received {sig.name}; stopping all processes")
        task = asyncio.get_running_loop().create_task(self._stop_all())
        self.signal_tasks.add(task)
        task.add_done_callback(self.signal_tasks.discard)

    async def _stop_all(self, force: bool = False) -> None:
        if self.stopping and not force:
            return
        self.stopping = True
        running = [p for p in self.procs if p.returncode is None]
        for proc in running:
            _signal_group(proc.pid, signal.SIGTERM)
        try:
            async with asyncio.timeout(self.args.kill_timeout):
                await asyncio.gather(*(p.wait() for p in running))
        except TimeoutError:
            for proc in running:
                if proc.returncode is None:
                    _signal_group(proc.pid, signal.SIGKILL)

    @staticmethod
    def _say(text: str) -> None:
        sys.stderr.write(f"[launcher] {text}\n")
        sys.stderr.flush()


async def _exit_of(rank: int, proc: asyncio.subprocess.Process) -> tuple[int, int]:
    return rank, await proc.wait()


def _die_with_parent_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the kernel kill the child if the launcher dies (Linux),
    even by SIGKILL, which no handler sees: no rank outlives its supervisor."""
    if sys.platform != "linux":
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded here, not in the child
    except (OSError, AttributeError):
        return None
    launcher = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != launcher:  # the launcher died before prctl took effect
            os._exit(1)

    return hook


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


async def _pump(stream: asyncio.StreamReader, out: BinaryIO, rank: int) -> None:
    # Chunks, not readline() (which raises on a line over its limit): every relayed line gets
    # the prefix and is written whole; a line longer than _LINE_PIECE is relayed as several
    # lines of at most that size, so memory stays bounded whatever a rank prints.
    prefix = f"[rank {rank}] ".encode()
    pending = b""
    while chunk := await stream.read(_LINE_PIECE):
        data = pending + chunk
        lines = data.split(b"\n")
        pending = lines.pop()
        while len(pending) >= _LINE_PIECE:
            lines.append(pending[:_LINE_PIECE])
            pending = pending[_LINE_PIECE:]
        if lines:
            _write(out, b"".join(prefix + line + b"\n" for line in lines))
    if pending:
        _write(out, prefix + pending + b"\n")


def _write(out: BinaryIO, data: bytes) -> None:
    try:
        out.write(data)
        out.flush()
    except (OSError, ValueError):
        pass  # our own output is gone (a closed pipe): keep draining, keep supervising


def main(argv: Sequence[str] | None = None) -> int:
    """Run the launcher; returns the exit code (see the module docstring)."""
    return asyncio.run(_Launcher(_parse(argv)).run())


if __name__ == "__main__":
    sys.exit(main())
