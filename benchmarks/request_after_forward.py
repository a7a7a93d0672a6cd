"""How long a request that arrived while a forward pass ran on the event loop waits once the
forward pass is over (issue #12, the aiohttp app's natural code).

The aiohttp app's `/health` p99 (`async_app.py`, natural mode) is made of requests that arrive
while a training step's forward pass runs on the loop: they wait for the forward pass, then
for the loop to read them (a reader callback) and run their handler (the task it wakes) while
the step's backward pass has just started on the engine's workers. This script measures that
second part alone, in one process, with the app's model (MLP 784-1024-1024-10, batch 256, SGD
with momentum, natural code): each step writes one request into a socket pair as its forward
pass ends, and a handler task (asyncio streams, as a server reads a request) notes when it
runs. Figures: the time from the end of the forward pass to the handler, per step, and how
much of it the loop's thread spent waiting for a core (its run-queue delay, from
``/proc/self/task/<tid>/schedstat``; Linux only).

Settings are the CPU budget's attributes (as in `budget_ab.py`), alternated block by block in
one process so that both see the same background load:

    python benchmarks/request_after_forward.py --blocks 6 --steps 40 \
        --setting released:hold_iterations=0 --setting held:hold_iterations=2

Before each block it waits (up to 20 s) until the machine looks idle (`budget_ab.py`).
Output per setting: the median, p90, p99 and longest wait over all steps, and the median
step time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from aioautograd.devices.cpu_budget import cpu_budget
from aioautograd.nn import functional as F
from benchmarks.async_app import SEED, AioTrainer
from benchmarks.budget_ab import _parse_setting, wait_until_idle


class _RunQueueDelay:
    """The calling thread's time spent runnable but not running so far (seconds; 0 where
    the kernel does not tell)."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open(
                f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY
            )
        except OSError:
            self._fd = None

    def __call__(self) -> float:
        if self._fd is None:
            return 0.0
        return int(os.pread(self._fd, 100, 0).split()[1]) / 1e9


async def _steps(
    trainer: AioTrainer, steps: int, delay: _RunQueueDelay
) -> tuple[list[float], list[float], list[float]]:
    """``steps`` natural training steps, each with a request arriving as its forward pass
    ends; returns the requests' waits, the loop thread's run-queue delay during each wait,
    and the steps' times (seconds)."""
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=ours)
    handled: list[tuple[float, float]] = []
    arrived = asyncio.Event()

    async def handler() -> None:
        while await reader.read(1):
            handled.append((time.perf_counter(), delay()))
            arrived.set()

    serving = asyncio.ensure_future(handler())
    waits: list[float] = []
    delays: list[float] = []
    step_times: list[float] = []
    try:
        for _ in range(steps):
            await asyncio.sleep(0.002)  # the loop idles between requests, as the app's does
            arrived.clear()
            start = time.perf_counter()
            logits = trainer.model(trainer.inputs)  # the forward pass, on the loop
            theirs.sendall(b"r")  # a request that arrived meanwhile
            forward_end, delay_at_end = time.perf_counter(), delay()
            loss = F.cross_entropy(logits, trainer.targets)
            trainer.optimizer.zero_grad()
            await loss.backward()
            trainer.optimizer.step()
            loss.item()
            step_times.append(time.perf_counter() - start)
            await arrived.wait()  # (handled during the backward pass, as a rule)
            waits.append(handled[-1][0] - forward_end)
            delays.append(handled[-1][1] - delay_at_end)
    finally:
        theirs.close()
        await serving
        writer.close()
    return waits, delays, step_times


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=6, help="blocks per setting")
    parser.add_argument("--steps", type=int, default=40, help="steps per block")
    parser.add_argument("--setting", action="append", required=True, help="name:attr=v+attr=v")
    args = parser.parse_args()
    settings = dict(_parse_setting(s) for s in args.setting)
    budget = cpu_budget()
    trainer = AioTrainer(SEED, offload=False)
    loop = asyncio.new_event_loop()
    delay = _RunQueueDelay()
    loop.run_until_complete(_steps(trainer, 5, delay))  # warm-up
    waits: dict[str, list[float]] = {name: [] for name in settings}
    delays: dict[str, list[float]] = {name: [] for name in settings}
    step_times: dict[str, list[float]] = {name: [] for name in settings}
    busy = 0
    for _ in range(args.blocks):
        for name, values in settings.items():
            for key, value in values.items():
                setattr(budget, key, type(getattr(budget, key))(value))
            busy += not wait_until_idle()
            block = loop.run_until_complete(_steps(trainer, args.steps, delay))
            block_waits, block_delays, block_steps = block
            waits[name].extend(block_waits)
            delays[name].extend(block_delays)
            step_times[name].extend(block_steps)
    loop.close()
    for name in settings:
        ms = 1e3 * np.asarray(waits[name])
        waited = 1e3 * np.asarray(delays[name])
        print(
            f"{name:10s} request after the forward pass: median {np.median(ms):5.2f} ms "
            f"p90 {np.percentile(ms, 90):5.2f} p99 {np.percentile(ms, 99):5.2f} "
            f"max {ms.max():5.2f} ms ({len(ms)} steps); loop thread waiting for a core "
            f"meanwhile: mean {waited.mean():5.2f} ms, p90 {np.percentile(waited, 90):5.2f}; "
            f"step median {1e3 * statistics.median(step_times[name]):5.1f} ms"
        )
    print(f"blocks started on a busy machine: {busy}")


if __name__ == "__main__":
    main()
