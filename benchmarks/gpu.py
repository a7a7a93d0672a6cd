"""The GPU figures beyond ``gpu_mlp``: ``gpu_concurrent`` (4 small MLPs trained at once on one
GPU, each on its own CUDA stream, vs one after another), ``gpu_concurrent_wide`` (the same
with 4096-wide models) and ``gpu_stall`` (how late a 1 ms heartbeat on the event loop runs
while a large GPU backward finishes).

Registered into ``benchmarks.workloads.REGISTRY`` when that module is imported; every
implementation is skipped, with its reason, where CuPy (or torch) sees no GPU.

Streams and asyncio: CuPy's current stream belongs to the *thread*, and every task of an
event loop runs on the loop's thread, so a task must not ``await`` inside
``with stream(s):`` (the tasks that run meanwhile would issue their work to ``s``). The
concurrent step below issues its forward and its update in such blocks and awaits the
backward between them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aioautograd as ag
from benchmarks.workloads import (
    LEARNING_RATE,
    SUBJECT,
    Case,
    Impl,
    Params,
    Workload,
    aio_cross_entropy,
    aio_relu,
    format_seconds,
    load_aio_mlp,
    mlp_data,
    register,
)


def _no_cupy_gpu() -> str | None:
    from aioautograd.devices import cuda

    return None if cuda.is_available() else "CuPy sees no GPU"


def _no_torch_gpu() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "this torch build sees no GPU"


# ---------------------------------------------------------------------------- concurrent


class _AioGpuModel:
    """One MLP on ``cuda:0`` with its own stream; plain SGD on raw parameters."""

    def __init__(self, params: Params, seed: int) -> None:
        from aioautograd.devices import current_stream, new_stream

        self.params = params
        self.seed = seed
        self.leaves = load_aio_mlp(self, {**params, "seed": seed}, "cuda:0")
        self.relu, _ = aio_relu()
        self.cross_entropy, _ = aio_cross_entropy()
        self.stream = new_stream("cuda:0")
        self.stream.wait_stream(current_stream("cuda:0"))  # the data was copied there

    def reset(self) -> None:
        from aioautograd.devices import current_stream

        data = mlp_data(self.params["widths"], self.params["batch"], seed=self.seed)
        with ag.no_grad():
            for leaf, value in zip(self.leaves, data.weights + data.biases, strict=True):
                leaf.copy_(ag.tensor(value, device="cuda:0"))
                leaf.grad = None
        self.stream.wait_stream(current_stream("cuda:0"))

    def forward(self) -> ag.Tensor:
        h = self.inputs
        last = len(self.weights) - 1
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            h = h @ w + b
            if i < last:
                h = self.relu(h)
        return self.cross_entropy(h, self.targets, self.one_hot)

    def update(self) -> None:
        with ag.no_grad():
            for p in self.leaves:
                p.sub_(p.grad, alpha=LEARNING_RATE)
                p.grad = None

    async def train(self, steps: int, use_stream: bool) -> float:
        from aioautograd.devices import stream

        side = self.stream if use_stream else None
        loss = None
        for _ in range(steps):
            with stream(side):
                loss = self.forward()
            await loss.backward()  # never inside `with stream(...)`: see the module docstring
            with stream(side):
                self.update()
        assert loss is not None
        return float(loss.item())


class _AioGpuTraining(Case):
    """aioautograd: ``models`` MLPs on one GPU, trained one after another or all at once
    with ``asyncio.gather`` (each on its own stream)."""

    def __init__(self, params: Params, concurrent: bool) -> None:
        self.concurrent = concurrent
        self.steps = params["steps"]
        self.models = [_AioGpuModel(params, seed) for seed in range(params["models"])]

    def prepare(self) -> None:
        for model in self.models:
            model.reset()

    async def run(self) -> float:
        if self.concurrent:
            losses = await asyncio.gather(*(m.train(self.steps, True) for m in self.models))
        else:
            losses = [await m.train(self.steps, False) for m in self.models]
        return float(sum(losses))

    def extras(self) -> dict[str, Any]:
        return {
            "library": "aioautograd",
            "schedule": "concurrent (asyncio.gather, a stream per model)"
            if self.concurrent
            else "sequential",
        }


class _TorchGpuTraining(Case):
    """torch: the same models and steps, one after another on the default stream, or one
    Python thread per model, each on its own CUDA stream."""

    def __init__(self, params: Params, threaded: bool) -> None:
        import torch

        self.torch = torch
        self.threaded = threaded
        self.steps = params["steps"]
        self.params = params
        self.models: list[dict[str, Any]] = []
        for seed in range(params["models"]):
            data = mlp_data(params["widths"], params["batch"], seed=seed)
            self.models.append(
                {
                    "weights": [
                        torch.tensor(w, device="cuda", requires_grad=True) for w in data.weights
                    ],
                    "biases": [
                        torch.tensor(b, device="cuda", requires_grad=True) for b in data.biases
                    ],
                    "inputs": torch.tensor(data.inputs, device="cuda"),
                    "targets": torch.tensor(data.targets, device="cuda"),
                    "stream": torch.cuda.Stream(),
                }
            )

    def prepare(self) -> None:
        torch = self.torch
        for seed, model in enumerate(self.models):
            data = mlp_data(self.params["widths"], self.params["batch"], seed=seed)
            with torch.no_grad():
                for p, value in zip(
                    model["weights"] + model["biases"], data.weights + data.biases, strict=True
                ):
                    p.copy_(torch.from_numpy(value))
                    p.grad = None
        torch.cuda.synchronize()

    def _train(self, index: int) -> float:
        torch = self.torch
        functional = torch.nn.functional
        model = self.models[index]
        params = model["weights"] + model["biases"]
        if self.threaded:
            torch.cuda.set_device(0)  # a fresh thread has no current CUDA context yet
        context = torch.cuda.stream(model["stream"]) if self.threaded else contextlib.nullcontext()
        loss = None
        with context:
            for _ in range(self.steps):
                h = model["inputs"]
                last = len(model["weights"]) - 1
                for i, (w, b) in enumerate(zip(model["weights"], model["biases"], strict=True)):
                    h = h @ w + b
                    if i < last:
                        h = functional.relu(h)
                loss = functional.cross_entropy(h, model["targets"])
                loss.backward()
                with torch.no_grad():
                    for p in params:
                        p.sub_(p.grad, alpha=LEARNING_RATE)
                        p.grad = None
            assert loss is not None
            return float(loss.item())

    def run(self) -> float:
        indices = range(len(self.models))
        if not self.threaded:
            return float(sum(self._train(i) for i in indices))
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(self.models)) as pool:
            return float(sum(pool.map(self._train, indices)))

    def extras(self) -> dict[str, Any]:
        return {
            "library": "torch",
            "schedule": "one thread and stream per model" if self.threaded else "sequential",
        }


def _gpu_concurrent_summary(lines: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """Headline: aioautograd sequential median / aioautograd concurrent median."""
    seq, conc = lines.get(f"{SUBJECT}-seq"), lines.get(SUBJECT)
    summary: dict[str, Any] = {}
    rows = [
        "| implementation | schedule | median | min | aioautograd sequential / this (median) |",
        "|---|---|---|---|---|",
    ]
    for name, line in lines.items():
        ratio = f"{seq['median_s'] / line['median_s']:.2f}x" if seq else "—"
        rows.append(
            f"| {name} | {line['schedule']} | {format_seconds(line['median_s'])} "
            f"| {format_seconds(line['min_s'])} | {ratio} |"
        )
    if seq and conc:
        summary["speedup"] = seq["median_s"] / conc["median_s"]
        summary["speedup_of_minima"] = seq["min_s"] / conc["min_s"]
        rows.append("")
        rows.append(
            f"Headline speed-up (aioautograd sequential / concurrent): "
            f"**{summary['speedup']:.2f}x** on medians, "
            f"{summary['speedup_of_minima']:.2f}x on minima."
        )
    return summary, "\n".join(rows)


def _gpu_training_impls() -> tuple[Impl, ...]:
    return (
        Impl(
            SUBJECT,
            lambda p: _AioGpuTraining(p, True),
            ("cupy",),
            unavailable=_no_cupy_gpu,
        ),
        Impl(
            f"{SUBJECT}-seq",
            lambda p: _AioGpuTraining(p, False),
            ("cupy",),
            main_table=False,
            unavailable=_no_cupy_gpu,
        ),
        Impl(
            "torch",
            lambda p: _TorchGpuTraining(p, False),
            ("torch",),
            unavailable=_no_torch_gpu,
        ),
        Impl(
            "torch-threads",
            lambda p: _TorchGpuTraining(p, True),
            ("torch",),
            main_table=False,
            unavailable=_no_torch_gpu,
        ),
    )


register(
    Workload(
        name="gpu_concurrent",
        description="4 MLPs 256-512-512-10 (batch 64), 20 SGD steps each on cuda:0: "
        "asyncio.gather with a stream per model vs one after another",
        sizes={
            "full": {"widths": [256, 512, 512, 10], "batch": 64, "models": 4, "steps": 20},
            "quick": {"widths": [256, 512, 512, 10], "batch": 64, "models": 4, "steps": 5},
            "tiny": {"widths": [8, 16, 16, 3], "batch": 4, "models": 4, "steps": 2},
        },
        repeats={"full": (2, 15), "quick": (1, 3), "tiny": (0, 1)},
        impls=_gpu_training_impls(),
        summary=_gpu_concurrent_summary,
    )
)

# The same with models whose GPU time per step is about the host's (gpu_mlp_wide's size).
register(
    Workload(
        name="gpu_concurrent_wide",
        description="4 MLPs 4096-4096-4096-10 (batch 1024), 5 SGD steps each on cuda:0: "
        "asyncio.gather with a stream per model vs one after another",
        sizes={
            "full": {"widths": [4096, 4096, 4096, 10], "batch": 1024, "models": 4, "steps": 5},
            "quick": {"widths": [4096, 4096, 4096, 10], "batch": 1024, "models": 4, "steps": 2},
            "tiny": {"widths": [8, 16, 16, 3], "batch": 4, "models": 4, "steps": 2},
        },
        repeats={"full": (2, 10), "quick": (1, 3), "tiny": (0, 1)},
        impls=_gpu_training_impls(),
        summary=_gpu_concurrent_summary,
    )
)


# --------------------------------------------------------------------------------- stall


class _AioGpuStall(Case):
    """The backward of a wide MLP on ``cuda:0`` (graph built untimed in ``prepare``), with a
    1 ms heartbeat task on the loop; times ``await loss.backward()`` and records how late
    each heartbeat tick that overlapped it woke."""

    PERIOD_S = 0.001

    def __init__(self, params: Params) -> None:
        self.leaves = load_aio_mlp(self, params, "cuda:0")
        self.relu, _ = aio_relu()
        self.cross_entropy, _ = aio_cross_entropy()
        self.lateness: list[float] = []
        self.loss: ag.Tensor | None = None

    def prepare(self) -> None:
        from aioautograd.devices import current_stream

        for leaf in self.leaves:
            leaf.grad = None
        h = self.inputs
        last = len(self.weights) - 1
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            h = h @ w + b
            if i < last:
                h = self.relu(h)
        self.loss = self.cross_entropy(h, self.targets, self.one_hot)
        stream = current_stream("cuda:0")
        assert stream is not None
        stream.synchronize()  # the forward is done: the timed region is the backward alone

    def begin_timed(self) -> None:
        self.lateness.clear()

    async def run(self) -> float:
        loss = self.loss
        assert loss is not None
        stop = False
        wakes: list[float] = []

        async def heartbeat() -> None:
            while not stop:
                await asyncio.sleep(self.PERIOD_S)
                wakes.append(time.perf_counter())

        ticker = asyncio.ensure_future(heartbeat())
        await asyncio.sleep(0.003)  # a few ticks first
        start = time.perf_counter()
        await loss.backward()
        end = time.perf_counter()
        stop = True
        await ticker
        self.timed_s = end - start
        previous = None
        for wake in wakes:
            if previous is not None and wake > start and previous < end:
                self.lateness.append(wake - previous - self.PERIOD_S)
            previous = wake
        return float(loss.item())

    def extras(self) -> dict[str, Any]:
        ordered = sorted(self.lateness)
        if not ordered:
            return {"ticks": 0}
        return {
            "ticks": len(ordered),
            "lateness_median_ms": round(1e3 * ordered[len(ordered) // 2], 3),
            "lateness_p99_ms": round(1e3 * ordered[int(0.99 * (len(ordered) - 1))], 3),
            "lateness_max_ms": round(1e3 * ordered[-1], 3),
        }


def _gpu_stall_summary(lines: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], str]:
    rows = [
        "| implementation | backward (median) | heartbeat ticks | lateness median | p99 | max |",
        "|---|---|---|---|---|---|",
    ]
    for name, line in lines.items():
        rows.append(
            f"| {name} | {format_seconds(line['median_s'])} | {line.get('ticks', 0)} "
            f"| {line.get('lateness_median_ms', '—')} ms | {line.get('lateness_p99_ms', '—')} ms "
            f"| {line.get('lateness_max_ms', '—')} ms |"
        )
    return {}, "\n".join(rows)


register(
    Workload(
        name="gpu_stall",
        description="1 ms heartbeat lateness during the backward of an MLP "
        "4096-4096-4096-4096-4096-10, batch 4096, on cuda:0",
        sizes={
            "full": {"widths": [4096, 4096, 4096, 4096, 4096, 10], "batch": 4096},
            "quick": {"widths": [4096, 4096, 4096, 4096, 4096, 10], "batch": 4096},
            "tiny": {"widths": [12, 16, 16, 10], "batch": 4},
        },
        repeats={"full": (2, 10), "quick": (1, 3), "tiny": (0, 1)},
        impls=(Impl(SUBJECT, _AioGpuStall, ("cupy",), unavailable=_no_cupy_gpu),),
        summary=_gpu_stall_summary,
    )
)
