"""Model-parallel training with distributed autograd: an MLP split across two workers.

Worker 0 holds the first layer and the data; worker 1 holds the rest of the model. Each
step runs the forward through an RPC, ``dist_autograd.backward`` sends the gradients back
across the split, and a ``DistributedOptimizer`` updates each worker's parameters where they
live. The same model is trained in a single process from the same initial weights, and the
two loss curves are compared.

Run on the embedded ``local`` backend (both workers are tasks of this process)::

    python -m aioautograd.examples.model_parallel

or as two processes over gRPC, started by the launcher (which sets ``RANK``, ``WORLD_SIZE``
and the backend; the script then uses gRPC without being told)::

    python -m aioautograd.distributed.run --nproc 2 -m aioautograd.examples.model_parallel
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

import numpy as np

import aioautograd as ag
from aioautograd import nn, optim
from aioautograd.distributed import autograd as dist_autograd
from aioautograd.distributed import rpc
from aioautograd.distributed.optim import DistributedOptimizer
from aioautograd.examples.data import make_spirals
from aioautograd.nn import functional as F

HIDDEN = 64
SEED = 1  # the initial weights' seed
LR = 0.2
MOMENTUM = 0.9
# Each worker's part of the model, by worker name (the local backend runs both in one
# process, so the registry is keyed by the worker that owns the part).
_stages: dict[str, nn.Module] = {}


def build_stages(seed: int) -> tuple[nn.Module, nn.Module]:
    """The two halves of the model, initialised deterministically."""
    ag.manual_seed(seed)
    first = nn.Sequential(nn.Linear(2, HIDDEN), nn.ReLU())
    second = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 3))
    return first, second


def training_data() -> tuple[ag.Tensor, ag.Tensor]:
    """The 600 spiral points (float32) and their labels (int64) every run trains on."""
    return make_spirals(200, 3, seed=0)


@rpc.register
async def create_stage(seed: int) -> list[rpc.RRef[Any]]:
    """Build the second half on the calling worker's peer; return RRefs to its parameters."""
    _, second = build_stages(seed)
    _stages[rpc.get_worker_info().name] = second
    return [rpc.RRef(p) for p in second.parameters()]


@rpc.register
async def stage_forward(h: ag.Tensor) -> ag.Tensor:
    """Run the second half on this worker (recorded by distributed autograd)."""
    out: ag.Tensor = _stages[rpc.get_worker_info().name](h)
    return out


async def train_distributed(steps: int, seed: int) -> tuple[list[float], list[float]]:
    """On worker 0: train the split model; returns every step's loss and duration (s)."""
    x, y = training_data()
    first, _ = build_stages(seed)
    remote_params = await rpc.rpc_async("worker1", create_stage, args=(seed,))
    params = [rpc.RRef(p) for p in first.parameters()] + list(remote_params)
    optimizer = DistributedOptimizer(optim.SGD, params, lr=LR, momentum=MOMENTUM)
    losses, durations = [], []
    for _ in range(steps):
        start = time.perf_counter()
        async with dist_autograd.context() as context_id:
            hidden = first(x)
            logits = await rpc.rpc_async("worker1", stage_forward, args=(hidden,))
            loss = F.cross_entropy(logits, y)
            await dist_autograd.backward(context_id, [loss])
            await optimizer.step(context_id)
        durations.append(time.perf_counter() - start)
        losses.append(loss.item())
    return losses, durations


async def train_single_process(steps: int, seed: int) -> list[float]:
    """The same model, data and optimizer in one process (the reference)."""
    x, y = training_data()
    first, second = build_stages(seed)
    model = nn.Sequential(first, second)
    optimizer = optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        await loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


async def worker(
    rank: int, world_size: int, backend: str, steps: int, report_json: bool = False
) -> list[float] | None:
    await rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, backend=backend)
    try:
        if rank != 0:
            return None
        losses, durations = await train_distributed(steps, seed=SEED)
        elapsed = sum(durations)
        if report_json:  # machine-readable step times and losses
            print(json.dumps({"backend": backend, "step_s": durations, "losses": losses}))
            return losses
        reference = await train_single_process(steps, seed=SEED)
        for step in range(0, steps, max(1, steps // 8)):
            print(
                f"step {step:3d}  split model loss {losses[step]:.5f}  "
                f"single process {reference[step]:.5f}"
            )
        gap = float(np.max(np.abs(np.array(losses) - np.array(reference))))
        print(
            f"final loss {losses[-1]:.5f} ({backend} backend, {steps} steps in "
            f"{elapsed:.2f} s); largest difference from single-process training: {gap:.2e}"
        )
        return losses
    finally:
        await rpc.shutdown()


async def main_local(steps: int, report_json: bool = False) -> list[float] | None:
    results = await asyncio.gather(
        *(worker(rank, 2, "local", steps, report_json) for rank in range(2))
    )
    return results[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--backend",
        choices=["local", "grpc"],
        help="local: both workers in this process (the default without the launcher); "
        "grpc: one worker per process (the default under the launcher)",
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--json", action="store_true", help="print step times as JSON")
    args = parser.parse_args()
    backend = _check_backend(parser, args.backend)
    if backend == "local":
        asyncio.run(main_local(args.steps, args.json))
    else:
        rank = int(os.environ["RANK"])
        asyncio.run(worker(rank, 2, backend, args.steps, args.json))


def _check_backend(parser: argparse.ArgumentParser, backend: str | None) -> str:
    """The backend to use, refusing combinations that cannot train one split model."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if not launched:
        if backend == "grpc":
            parser.error(
                "--backend grpc runs one worker per process: start the two workers with the "
                "launcher, python -m aioautograd.distributed.run --nproc 2 -m "
                "aioautograd.examples.model_parallel"
            )
        return "local"
    world = os.environ["WORLD_SIZE"]
    if backend == "local":
        parser.error(
            f"--backend local runs both workers inside one process, but the launcher started "
            f"{world} processes: each would train its own copy. Drop --backend local (the "
            "launcher's backend is used), or run without the launcher."
        )
    if world != "2":
        parser.error(f"the model is split across exactly 2 workers: use --nproc 2, not {world}")
    return os.environ.get("AIOAUTOGRAD_RPC_BACKEND") or "grpc"


if __name__ == "__main__":
    main()
