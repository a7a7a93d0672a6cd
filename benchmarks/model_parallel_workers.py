"""Worker processes of the ``model_parallel`` benchmark (``benchmarks/distributed.py``).

One training step of ``aioautograd.examples.model_parallel`` (2-64 on worker 0, 64-64-3 on
worker 1, 600 spiral points, SGD with momentum through a distributed optimizer), run by:

- ``--backend local``: both aioautograd workers in this one process;
- ``--backend grpc``: one aioautograd worker per process, started by
  ``python -m aioautograd.distributed.run --nproc 2 -m benchmarks.model_parallel_workers``;
- ``--backend torch``: one ``torch.distributed.rpc`` worker per process (TensorPipe with its
  default transports, rank 0's address from ``MASTER_ADDR``/``MASTER_PORT``), with the same
  initial weights and data converted from the example's NumPy arrays;
- ``--backend torch-uv``: the same with TensorPipe limited to its ``uv`` transport (TCP over
  loopback, as gRPC). By default TensorPipe picks its shared-memory transport between two
  processes of one host, whose reactor threads busy-poll: about one core per process, even
  between steps.

Rank 0 connects to the driver on ``127.0.0.1:--control``, sends ``{"ready": ...}`` once the
model and the optimizer exist, then runs one step per ``step`` line it receives and answers
``{"step_s": ..., "loss": ...}`` (the step timed by rank 0 itself, from entering the
distributed autograd context to the end of the optimizer step, as in the example); ``quit``
(or the connection closing) ends the run and shuts the RPC world down.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import time
from typing import Any

from aioautograd import optim
from aioautograd.distributed import autograd as dist_autograd
from aioautograd.distributed import rpc
from aioautograd.distributed.optim import DistributedOptimizer
from aioautograd.examples import model_parallel as example
from aioautograd.nn import functional as F

# ------------------------------------------------------------------------- the protocol


def ready_line(backend: str) -> bytes:
    """The first line rank 0 sends: the model and the optimizer are set up."""
    return json.dumps({"ready": backend, "pid": os.getpid()}).encode() + b"\n"


def step_line(step_s: float, loss: float) -> bytes:
    """Rank 0's answer to one ``step`` command."""
    return json.dumps({"step_s": step_s, "loss": loss}).encode() + b"\n"


# -------------------------------------------------------------------- aioautograd side


class AioStepper:
    """Rank 0's side of the example's training loop, one step at a time (same set-up and
    same step body as ``example.train_distributed``)."""

    async def setup(self) -> None:
        self.x, self.y = example.training_data()
        self.first, _ = example.build_stages(example.SEED)
        remote = await rpc.rpc_async("worker1", example.create_stage, args=(example.SEED,))
        params = [rpc.RRef(p) for p in self.first.parameters()] + list(remote)
        self.optimizer = DistributedOptimizer(
            optim.SGD, params, lr=example.LR, momentum=example.MOMENTUM
        )

    async def step(self) -> tuple[float, float]:
        """One timed training step: (seconds, loss)."""
        start = time.perf_counter()
        async with dist_autograd.context() as context_id:
            hidden = self.first(self.x)
            logits = await rpc.rpc_async("worker1", example.stage_forward, args=(hidden,))
            loss = F.cross_entropy(logits, self.y)
            await dist_autograd.backward(context_id, [loss])
            await self.optimizer.step(context_id)
        duration = time.perf_counter() - start
        return duration, loss.item()


async def _serve_aio(backend: str, control_port: int) -> None:
    """Rank 0: set up, then answer the driver's commands until ``quit``."""
    stepper = AioStepper()
    await stepper.setup()
    reader, writer = await asyncio.open_connection("127.0.0.1", control_port)
    try:
        writer.write(ready_line(backend))
        await writer.drain()
        while (await reader.readline()).strip() == b"step":
            writer.write(step_line(*await stepper.step()))
            await writer.drain()
    finally:
        writer.close()
        await writer.wait_closed()


async def _aio_worker(
    backend: str, rank: int, world_size: int, control_port: int, label: str | None = None
) -> None:
    """One worker on ``backend``; rank 0 serves the driver, saying it is ``label`` (default:
    the backend's name)."""
    await rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, backend=backend)
    try:
        if rank == 0:
            await _serve_aio(label or backend, control_port)
    finally:
        await rpc.shutdown()


async def _aio_local(control_port: int) -> None:
    """Both workers as tasks of this process (the ``local`` backend)."""
    await asyncio.gather(*(_aio_worker("local", rank, 2, control_port) for rank in range(2)))


# -------------------------------------------------------------------------- torch side

_torch_stage: Any = None  # worker 1's half of the torch model


def torch_copy(stage: Any) -> Any:
    """A torch ``nn.Sequential`` with the layers and the values of the example's ``stage``
    (2-64 + ReLU, or 64-64 + ReLU + 64-3), its parameters float32 as the example's are."""
    import torch

    params = list(stage.parameters())
    if len(params) == 2:
        layers = [torch.nn.Linear(2, example.HIDDEN), torch.nn.ReLU()]
    else:
        layers = [
            torch.nn.Linear(example.HIDDEN, example.HIDDEN),
            torch.nn.ReLU(),
            torch.nn.Linear(example.HIDDEN, 3),
        ]
    module = torch.nn.Sequential(*layers)
    with torch.no_grad():
        for target, source in zip(module.parameters(), params, strict=True):
            values = torch.from_numpy(source.detach().numpy().copy())
            if target.shape != values.shape or values.dtype != torch.float32:
                raise ValueError(f"parameter {tuple(values.shape)} {values.dtype} does not fit")
            target.copy_(values)
    return module


def torch_create_stage(seed: int) -> list[Any]:
    """On worker 1: build its half from the example's weights; RRefs to its parameters."""
    from torch.distributed import rpc as torch_rpc

    global _torch_stage
    _, second = example.build_stages(seed)
    _torch_stage = torch_copy(second)
    return [torch_rpc.RRef(p) for p in _torch_stage.parameters()]


def torch_stage_forward(hidden: Any) -> Any:
    """On worker 1: its half of the forward (recorded by torch's distributed autograd)."""
    return _torch_stage(hidden)


class TorchStepper:
    """The same step with ``torch.distributed.rpc`` and ``torch.distributed.autograd``."""

    def setup(self) -> None:
        import torch
        from torch.distributed import rpc as torch_rpc
        from torch.distributed.optim import DistributedOptimizer as TorchDistributedOptimizer

        self.torch = torch
        x, y = example.training_data()
        self.x, self.y = torch.from_numpy(x.numpy().copy()), torch.from_numpy(y.numpy().copy())
        first, _ = example.build_stages(example.SEED)
        self.first = torch_copy(first)
        remote = torch_rpc.rpc_sync("worker1", torch_create_stage, args=(example.SEED,))
        params = [torch_rpc.RRef(p) for p in self.first.parameters()] + list(remote)
        self.optimizer = TorchDistributedOptimizer(
            torch.optim.SGD, params, lr=example.LR, momentum=example.MOMENTUM
        )

    def step(self) -> tuple[float, float]:
        """One timed training step: (seconds, loss)."""
        import torch.distributed.autograd as torch_dist_autograd
        from torch.distributed import rpc as torch_rpc

        functional = self.torch.nn.functional
        start = time.perf_counter()
        with torch_dist_autograd.context() as context_id:
            hidden = self.first(self.x)
            logits = torch_rpc.rpc_sync("worker1", torch_stage_forward, args=(hidden,))
            loss = functional.cross_entropy(logits, self.y)
            torch_dist_autograd.backward(context_id, [loss])
            self.optimizer.step(context_id)
        duration = time.perf_counter() - start
        return duration, loss.item()


def _serve_torch(backend: str, control_port: int) -> None:
    """Rank 0: set up, then answer the driver's commands until ``quit``."""
    stepper = TorchStepper()
    stepper.setup()
    with socket.create_connection(("127.0.0.1", control_port)) as conn:
        commands = conn.makefile("rb")
        conn.sendall(ready_line(backend))
        while commands.readline().strip() == b"step":
            conn.sendall(step_line(*stepper.step()))


def torch_backend_options(backend: str) -> Any:
    """TensorPipe's options for ``backend`` (``torch``: its defaults; ``torch-uv``: its TCP
    transport only); rank 0's address from ``MASTER_ADDR``/``MASTER_PORT``."""
    from torch.distributed import rpc as torch_rpc

    transports = {"_transports": ["uv"]} if backend == "torch-uv" else {}
    return torch_rpc.TensorPipeRpcBackendOptions(init_method="env://", **transports)


def _torch_worker(backend: str, rank: int, control_port: int) -> None:
    from torch.distributed import rpc as torch_rpc

    torch_rpc.init_rpc(
        f"worker{rank}",
        backend=torch_rpc.BackendType.TENSORPIPE,
        rank=rank,
        world_size=2,
        rpc_backend_options=torch_backend_options(backend),
    )
    try:
        if rank == 0:
            _serve_torch(backend, control_port)
    finally:
        torch_rpc.shutdown()


# ------------------------------------------------------------------------------- main


# The ``aioautograd-awake`` variant's GrpcOptions.keep_awake_s: a step is ~4-10 ms.
KEEP_AWAKE_S = 0.01


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--backend",
        choices=("local", "grpc", "grpc-uvloop", "grpc-awake", "torch", "torch-uv"),
        required=True,
    )
    parser.add_argument("--control", type=int, required=True, help="the driver's port")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    if args.backend == "local":
        asyncio.run(_aio_local(args.control))
    elif args.backend == "grpc":
        world_size = int(os.environ["WORLD_SIZE"])
        asyncio.run(_aio_worker("grpc", rank, world_size, args.control))
    elif args.backend == "grpc-awake":  # GrpcOptions.keep_awake_s, read from the environment
        os.environ["AIOAUTOGRAD_KEEP_AWAKE_S"] = str(KEEP_AWAKE_S)
        world_size = int(os.environ["WORLD_SIZE"])
        asyncio.run(_aio_worker("grpc", rank, world_size, args.control, args.backend))
    elif args.backend == "grpc-uvloop":
        import uvloop

        world_size = int(os.environ["WORLD_SIZE"])
        uvloop.run(_aio_worker("grpc", rank, world_size, args.control, args.backend))
    else:
        _torch_worker(args.backend, rank, args.control)


if __name__ == "__main__":
    # Run the module under its own name, so that torch's RPC pickles
    # ``benchmarks.model_parallel_workers.torch_stage_forward``, not ``__main__``'s.
    from benchmarks.model_parallel_workers import main as _main

    _main()
