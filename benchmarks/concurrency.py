"""The spec §8 figures about concurrency: ``concurrent`` (4 models trained at once with
``asyncio.gather`` vs one after another) and ``stall`` / ``stall_chain`` (how late a 1 ms
heartbeat on the event loop runs while a large backward is under way).

Registered into ``benchmarks.workloads.REGISTRY`` when that module is imported. Both figures
have variants (``Impl.main_table`` false) that only appear in their own summary table: the
main tables keep one column per library.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import numpy as np

import aioautograd as ag
from benchmarks.workloads import (
    CHAIN_FACTOR,
    MLP_SIZES,
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

# --------------------------------------------------------------------------------- helpers


def _format_ms(ms: float) -> str:
    return f"{ms:.3g} ms"


@functools.cache
def _threadpool_controller() -> Any:
    """threadpoolctl's view of the loaded thread pools, made once (making it scans the loaded
    libraries: ~0.2 ms; limiting through it then costs a few µs)."""
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


def _blas_limit(threads: int | None) -> AbstractContextManager[Any]:
    """NumPy's BLAS limited to ``threads`` while the context is active (``None``: as is)."""
    if threads is None:
        return nullcontext()
    return _threadpool_controller().limit(limits=threads, user_api="blas")


@contextmanager
def _switch_interval(seconds: float | None) -> Iterator[None]:
    """``sys.setswitchinterval(seconds)`` while the context is active (``None``: as is)."""
    previous = sys.getswitchinterval()
    if seconds is not None:
        sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def _blas_threads_now() -> int | None:
    """Threads of NumPy's BLAS as threadpoolctl sees them (``None`` if it cannot tell)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    pools = [p for p in threadpool_info() if p.get("user_api") == "blas"]
    numpy_pools = [p for p in pools if "numpy" in str(p.get("filepath", ""))]
    chosen = numpy_pools or pools
    return int(chosen[0]["num_threads"]) if chosen else None


# ------------------------------------------------------------------------------ concurrent
# `models` MLPs (same widths, weights and batch drawn from seeds 0..models-1), each trained
# for `steps` SGD-with-momentum steps on its own fixed batch. One repeat trains all of them
# from their initial weights (reset untimed in `prepare`, optimizers recreated). The value
# is the sum of the models' last losses, the same whatever the schedule.

TRAIN_LR = 0.01
TRAIN_MOMENTUM = 0.9


def _linear_weights(params: Params) -> list[tuple[list[np.ndarray], list[np.ndarray]]]:
    """Per model: weights as ``(out, in)`` (``nn.Linear``'s layout) and biases."""
    out = []
    for seed in range(params["models"]):
        data = mlp_data(params["widths"], params["batch"], seed=seed)
        out.append(([np.ascontiguousarray(w.T) for w in data.weights], data.biases))
    return out


class _AioTraining(Case):
    """aioautograd: the models trained one after another, or all at once with
    ``asyncio.gather``, written the natural way (forward and ``optimizer.step()`` in the
    coroutine, ``await loss.backward()``) or with the whole step in ``aioautograd.offload``.
    The default environment: no BLAS limit (the engine's CPU budget manages BLAS threads).
    A 1 ms heartbeat runs on the loop meanwhile; its tick delays go in the JSON line.
    ``policy`` (optional) is installed as the default engine's for the runs."""

    def __init__(
        self,
        params: Params,
        concurrent: bool,
        offload: bool,
        policy: ag.engine.EnginePolicy | None = None,
    ) -> None:
        from aioautograd import nn

        self.concurrent = concurrent
        self.offload = offload
        self.engine = ag.engine.Engine(policy) if policy is not None else None
        self.steps = params["steps"]
        self.initial = _linear_weights(params)
        widths = params["widths"]
        self.models: list[Any] = []
        self.batches: list[tuple[ag.Tensor, ag.Tensor]] = []
        for seed in range(params["models"]):
            layers: list[Any] = []
            for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
                layers.append(nn.Linear(fan_in, fan_out))
                if i < len(widths) - 2:
                    layers.append(nn.ReLU())
            self.models.append(nn.Sequential(*layers))
            data = mlp_data(widths, params["batch"], seed=seed)
            self.batches.append((ag.tensor(data.inputs), ag.tensor(data.targets)))
        self.default_blas_threads = _blas_threads_now()
        self.delays_ms: list[float] = []
        self.walls_s: list[float] = []

    def prepare(self) -> None:
        from aioautograd import optim

        self.optimizers = []
        for model, (weights, biases) in zip(self.models, self.initial, strict=True):
            linears = [m for m in model if hasattr(m, "weight")]
            with ag.no_grad():
                for layer, w, b in zip(linears, weights, biases, strict=True):
                    layer.weight.copy_(ag.from_numpy(w))
                    layer.bias.copy_(ag.from_numpy(b))
            model.zero_grad()
            self.optimizers.append(
                optim.SGD(model.parameters(), lr=TRAIN_LR, momentum=TRAIN_MOMENTUM)
            )

    def begin_timed(self) -> None:
        self.delays_ms.clear()
        self.walls_s.clear()

    @staticmethod
    def _step(model: Any, optimizer: Any, inputs: ag.Tensor, targets: ag.Tensor) -> float:
        from aioautograd.nn import functional as F

        loss = F.cross_entropy(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward_sync()
        optimizer.step()
        return float(loss.item())

    async def _train(self, index: int) -> float:
        from aioautograd.nn import functional as F

        model, optimizer = self.models[index], self.optimizers[index]
        inputs, targets = self.batches[index]
        value = 0.0
        for _ in range(self.steps):
            if self.offload:
                value = await ag.offload(self._step, model, optimizer, inputs, targets)
                continue
            loss = F.cross_entropy(model(inputs), targets)
            optimizer.zero_grad()
            await loss.backward()
            optimizer.step()
            value = float(loss.item())
        return value

    async def run(self) -> float:
        heartbeat = Heartbeat(0.001)
        with _default_engine(self.engine):
            heartbeat.start()
            await asyncio.sleep(HEARTBEAT_LEAD_S)
            start = time.perf_counter()
            if self.concurrent:
                losses = await asyncio.gather(*(self._train(i) for i in range(len(self.models))))
            else:
                losses = [await self._train(i) for i in range(len(self.models))]
            end = time.perf_counter()
            await heartbeat.stop()
        self.timed_s = end - start
        self.walls_s.append(self.timed_s)
        self.delays_ms.extend(d * 1e3 for d in heartbeat.delays_s(start, end))
        return float(sum(losses))

    def extras(self) -> dict[str, Any]:
        delays = np.asarray(self.delays_ms or [0.0])
        how = "ag.offload(step)" if self.offload else "natural (forward on the loop)"
        return {
            "library": "aioautograd",
            "schedule": ("concurrent (asyncio.gather)" if self.concurrent else "sequential")
            + f", {how}",
            "blas_threads": self.default_blas_threads,
            "engine": "default" if self.engine is None else repr(self.engine.policy),
            "tick_p99_ms": round(float(np.percentile(delays, 99)), 3),
            "tick_max_ms": round(float(delays.max()), 3),
            "wall_spread": round(max(self.walls_s) / min(self.walls_s), 3)
            if self.walls_s
            else None,
        }


class _TorchTraining(Case):
    """PyTorch: the models one after another (default intra-op threads), or one Python
    thread per model with one intra-op thread each."""

    def __init__(self, params: Params, threaded: bool) -> None:
        import torch

        self.torch = torch
        self.threaded = threaded
        self.steps = params["steps"]
        self.initial = _linear_weights(params)
        widths = params["widths"]
        self.models: list[Any] = []
        self.batches: list[tuple[Any, Any]] = []
        for seed in range(params["models"]):
            layers: list[Any] = []
            for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
                layers.append(torch.nn.Linear(fan_in, fan_out))
                if i < len(widths) - 2:
                    layers.append(torch.nn.ReLU())
            self.models.append(torch.nn.Sequential(*layers))
            data = mlp_data(widths, params["batch"], seed=seed)
            self.batches.append((torch.tensor(data.inputs), torch.tensor(data.targets)))
        self.default_threads = torch.get_num_threads()

    def prepare(self) -> None:
        torch = self.torch
        self.optimizers = []
        for model, (weights, biases) in zip(self.models, self.initial, strict=True):
            linears = [m for m in model if isinstance(m, torch.nn.Linear)]
            with torch.no_grad():
                for layer, w, b in zip(linears, weights, biases, strict=True):
                    layer.weight.copy_(torch.from_numpy(w))
                    layer.bias.copy_(torch.from_numpy(b))
            model.zero_grad(set_to_none=True)
            self.optimizers.append(
                torch.optim.SGD(model.parameters(), lr=TRAIN_LR, momentum=TRAIN_MOMENTUM)
            )

    def _train(self, index: int) -> float:
        functional = self.torch.nn.functional
        model, optimizer = self.models[index], self.optimizers[index]
        inputs, targets = self.batches[index]
        loss = None
        for _ in range(self.steps):
            loss = functional.cross_entropy(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        assert loss is not None
        return float(loss.item())

    def run(self) -> float:
        indices = range(len(self.models))
        if not self.threaded:
            return float(sum(self._train(i) for i in indices))
        torch = self.torch
        previous = torch.get_num_threads()
        torch.set_num_threads(1)  # one intra-op thread per model thread: no oversubscription
        try:
            with ThreadPoolExecutor(len(self.models)) as pool:
                return float(sum(pool.map(self._train, indices)))
        finally:
            torch.set_num_threads(previous)

    def extras(self) -> dict[str, Any]:
        return {
            "library": "torch",
            "schedule": "one thread per model" if self.threaded else "sequential",
            "torch_threads": 1 if self.threaded else self.default_threads,
        }


def _concurrent_summary(lines: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """Speed-ups over the best aioautograd sequential median, for natural code and for the
    off-loop step, and the 2-core ceiling from the one-core run (see README)."""

    def median(name: str) -> float | None:
        line = lines.get(name)
        return None if line is None else float(line["median_s"])

    sequential = [n for n in ("aioautograd-seq", "aioautograd-seq-offload") if n in lines]
    seq = min(sequential, key=lambda n: lines[n]["median_s"]) if sequential else None
    summary: dict[str, Any] = {"sequential_best": seq}
    if seq is not None:
        best_seq = lines[seq]["median_s"]
        for name, key in (
            ("aioautograd", "speedup_natural"),
            ("aioautograd-offload", "speedup_offload"),
            ("aioautograd-hold", "speedup_hold"),
        ):
            if name in lines:
                summary[key] = best_seq / lines[name]["median_s"]
        one_core = median("aioautograd-seq-1core")
        if one_core is not None:
            # T1 = P + B on one core; best sequential T2 ~ P + B/2 on two: P = 2 T2 - T1.
            python_s = max(0.0, 2 * best_seq - one_core)
            ceiling_s = max(python_s, one_core / 2)
            summary["python_s"] = python_s
            summary["blas_one_thread_s"] = one_core - python_s
            summary["ceiling_speedup"] = best_seq / ceiling_s
    rows = [
        "| implementation | schedule | median | min | best sequential / this | tick p99 | "
        "tick max | wall max/min |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, line in lines.items():
        ratio = f"{lines[seq]['median_s'] / line['median_s']:.2f}x" if seq else "—"
        ticks = (
            f"{line['tick_p99_ms']:.3g} ms | {line['tick_max_ms']:.3g} ms | "
            f"{line['wall_spread']:.2f}"
            if "tick_p99_ms" in line
            else "— | — | —"
        )
        rows.append(
            f"| {name} | {line['schedule']} | {format_seconds(line['median_s'])} "
            f"| {format_seconds(line['min_s'])} | {ratio} | {ticks} |"
        )
    if "speedup_natural" in summary or "speedup_offload" in summary:
        rows.append("")
        parts = []
        if "speedup_natural" in summary:
            parts.append(f"natural code **{summary['speedup_natural']:.2f}x**")
        if "speedup_offload" in summary:
            parts.append(f"`offload` step **{summary['speedup_offload']:.2f}x**")
        text = f"Concurrent over the best sequential ({seq}): " + ", ".join(parts)
        if "ceiling_speedup" in summary:
            text += (
                f"; 2-core ceiling {summary['ceiling_speedup']:.2f}x "
                f"(P = {format_seconds(summary['python_s'])}, "
                f"B = {format_seconds(summary['blas_one_thread_s'])} on one core)"
            )
        rows.append(text + ".")
    return summary, "\n".join(rows)


_TRAINING_SIZES = {
    "full": {"widths": [784, 512, 512, 10], "batch": 256, "models": 4, "steps": 8},
    "quick": {"widths": [784, 512, 512, 10], "batch": 256, "models": 4, "steps": 3},
    "tiny": {"widths": [8, 16, 16, 3], "batch": 4, "models": 4, "steps": 2},
}
# Python and BLAS time about balanced (see README): where concurrency has the most to gain.
_TRAINING_MID_SIZES = {
    "full": {"widths": [256, 256, 256, 10], "batch": 64, "models": 4, "steps": 20},
    "quick": {"widths": [256, 256, 256, 10], "batch": 64, "models": 4, "steps": 5},
    "tiny": {"widths": [8, 16, 16, 3], "batch": 4, "models": 4, "steps": 2},
}


def _aio_training(
    concurrent: bool, offload: bool, policy: ag.engine.EnginePolicy | None = None
) -> Callable[[Params], Case]:
    return lambda params: _AioTraining(params, concurrent, offload, policy)


def _training_impls() -> tuple[Impl, ...]:
    return (
        # The subject: natural code, four coroutines at once, default environment.
        Impl("aioautograd", _aio_training(True, False)),
        Impl("aioautograd-offload", _aio_training(True, True), main_table=False),
        Impl(
            "aioautograd-hold",
            _aio_training(True, False, ag.engine.EnginePolicy(loop_shares_cores=False)),
            main_table=False,
        ),
        Impl("aioautograd-seq", _aio_training(False, False), main_table=False),
        Impl("aioautograd-seq-offload", _aio_training(False, True), main_table=False),
        Impl(
            "aioautograd-seq-1core",
            _aio_training(False, False, ag.engine.EnginePolicy(cpu_cores=1)),
            main_table=False,
        ),
        Impl("torch", lambda params: _TorchTraining(params, False), ("torch",)),
        Impl(
            "torch-threads",
            lambda params: _TorchTraining(params, True),
            ("torch",),
            main_table=False,
        ),
    )


register(
    Workload(
        name="concurrent",
        description="4 MLPs 784-512-512-10 (batch 256), 8 SGD steps each: asyncio.gather on "
        "one engine (natural code, or the offload step) vs one after another",
        sizes=_TRAINING_SIZES,
        repeats={"full": (1, 5), "quick": (1, 2), "tiny": (0, 1)},
        impls=_training_impls(),
        summary=_concurrent_summary,
    )
)
register(
    Workload(
        name="concurrent_mid",
        description="4 MLPs 256-256-256-10 (batch 64), 20 SGD steps each: the same schedules "
        "where Python and BLAS time are balanced",
        sizes=_TRAINING_MID_SIZES,
        repeats={"full": (1, 5), "quick": (1, 2), "tiny": (0, 1)},
        impls=_training_impls(),
        summary=_concurrent_summary,
    )
)


# ----------------------------------------------------------------------------------- stall
# A heartbeat task sleeps `period` on the event loop, over and over, and records when it
# wakes. The graph is built in `prepare` (untimed); `run` starts the heartbeat, lets it tick
# for a few periods, then runs the backward and records how late each tick whose sleep
# overlapped the backward woke (wake time - (previous wake + period)); only the backward is
# timed. A backward that blocks the loop shows as one tick late by about its whole duration.

HEARTBEAT_LEAD_S = 0.003  # heartbeat ticks before the backward starts


class Heartbeat:
    """A task ticking every ``period_s`` on the running loop, recording its wake-up times."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self.wakes: list[float] = []
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.wakes = [time.perf_counter()]
        self._stopping = False
        self._task = asyncio.get_running_loop().create_task(self._beat())

    async def _beat(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.period_s)
            self.wakes.append(time.perf_counter())

    async def stop(self) -> None:
        """Stop after the next tick (so that a tick blocked until now is recorded)."""
        self._stopping = True
        assert self._task is not None
        await self._task

    def delays_s(self, start: float, end: float) -> list[float]:
        """How late each tick whose sleep overlapped ``[start, end]`` woke, in seconds."""
        return [
            max(0.0, woke - previous - self.period_s)
            for previous, woke in itertools.pairwise(self.wakes)
            if woke >= start and previous <= end
        ]


class _GcWatch:
    """Records the full (generation 2) collections of the cyclic GC, on any thread.

    A collection holds the GIL throughout, so one that starts during a backward (triggered
    by an allocation on a worker or on the loop) stalls the loop for all of its duration.
    """

    def __init__(self) -> None:
        self.pauses: list[tuple[float, float]] = []  # (start, end)
        self._starts: dict[int, float] = {}

    def __enter__(self) -> _GcWatch:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        now = time.perf_counter()
        thread = threading.get_ident()
        if phase == "start":
            self._starts[thread] = now
        elif thread in self._starts:
            self.pauses.append((self._starts.pop(thread), now))


class _StallCase(Case):
    """A backward (``backward()``) run under a heartbeat; keeps the tick delays, and counts
    the runs whose window held a full GC collection (whose pause the loop then feels)."""

    how = ""  # how the backward runs, for the summary table

    def __init__(self, params: Params) -> None:
        self.period_s = params["period_s"]
        self.delays_ms: list[float] = []
        self.run_max_ms: list[float] = []
        self.gc_pauses_ms: list[float] = []  # full collections inside timed windows

    async def backward(self) -> float:
        """The backward pass; returns a checksum of the gradient."""
        raise NotImplementedError

    def begin_timed(self) -> None:
        self.delays_ms.clear()
        self.run_max_ms.clear()
        self.gc_pauses_ms.clear()

    async def run(self) -> float:
        heartbeat = Heartbeat(self.period_s)
        heartbeat.start()
        await asyncio.sleep(HEARTBEAT_LEAD_S)
        with _GcWatch() as watch:
            start = time.perf_counter()
            checksum = await self.backward()
            end = time.perf_counter()
        await heartbeat.stop()
        self.timed_s = end - start
        delays = [d * 1e3 for d in heartbeat.delays_s(start, end)]
        self.delays_ms.extend(delays)
        self.run_max_ms.append(max(delays, default=0.0))
        self.gc_pauses_ms.extend((b - a) * 1e3 for a, b in watch.pauses)
        return checksum

    def extras(self) -> dict[str, Any]:
        delays = np.asarray(self.delays_ms or [0.0])
        return {
            "backward": self.how,
            "period_ms": self.period_s * 1e3,
            "ticks": len(self.delays_ms),
            "tick_max_ms": round(float(delays.max()), 3),
            "tick_p99_ms": round(float(np.percentile(delays, 99)), 3),
            "tick_p50_ms": round(float(np.percentile(delays, 50)), 3),
            "run_max_median_ms": round(statistics.median(self.run_max_ms or [0.0]), 3),
            "gc2_in_window": len(self.gc_pauses_ms),
            "gc2_max_ms": round(max(self.gc_pauses_ms, default=0.0), 3),
        }


class _AioStall(_StallCase):
    """``await loss.backward()``; optionally with NumPy's BLAS limited to ``blas_threads``,
    the interpreter's GIL switch interval set to ``switch_interval_s`` during the backward, or
    on an engine of its own whose CPU workers run at ``worker_nice`` (the default engine's: 0)."""

    def __init__(
        self,
        params: Params,
        blas_threads: int | None = None,
        switch_interval_s: float | None = None,
        worker_nice: int | None = None,
    ) -> None:
        super().__init__(params)
        self.params = params
        self.blas_threads = blas_threads
        self.switch_interval_s = switch_interval_s
        self.how = "await loss.backward() (engine threads)"
        if blas_threads is not None:
            self.how += f", NumPy BLAS limited to {blas_threads} thread(s)"
        if switch_interval_s is not None:
            self.how += f", sys.setswitchinterval({switch_interval_s:g})"
        self.engine: ag.engine.Engine | None = None
        if worker_nice is not None:
            self.how += f", CPU workers at nice +{worker_nice}"
            self.engine = ag.engine.Engine(worker_nice=worker_nice)
        if params["graph"] == "mlp":
            self.leaves = load_aio_mlp(self, params)
            self.relu, _ = aio_relu()
            self.cross_entropy, _ = aio_cross_entropy()
        else:
            self.x = ag.tensor(_chain_input(), requires_grad=True)
            self.leaves = [self.x]

    def prepare(self) -> None:
        for leaf in self.leaves:
            leaf.grad = None
        # The BLAS limit covers the forward too: OpenBLAS threads woken by a forward matmul
        # spin for a while after it and would compete with the loop during the backward.
        with _blas_limit(self.blas_threads):
            self.loss = self._forward()

    def _forward(self) -> ag.Tensor:
        if self.params["graph"] == "mlp":
            h = self.inputs
            last = len(self.weights) - 1
            for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
                h = h @ w + b
                if i < last:
                    h = self.relu(h)
            return self.cross_entropy(h, self.targets, self.one_hot)
        h = self.x
        for _ in range(self.params["n"]):
            h = h * CHAIN_FACTOR
        return h.sum()

    async def backward(self) -> float:
        with (
            _blas_limit(self.blas_threads),
            _switch_interval(self.switch_interval_s),
            _default_engine(self.engine),
        ):
            await self.loss.backward()
        return float(self.leaves[0].grad.numpy().sum())


@contextmanager
def _default_engine(engine: ag.engine.Engine | None) -> Iterator[None]:
    """Make ``engine`` (if given) the one ``backward`` uses, meanwhile."""
    if engine is None:
        yield
        return
    saved = ag.set_default_engine(engine)  # also applies its policy to the CPU budget
    try:
        yield
    finally:
        ag.set_default_engine(saved if saved is not None else ag.engine.Engine())


class _TorchStall(_StallCase):
    """torch's ``loss.backward()`` called in the coroutine (blocks the loop), or in
    ``asyncio.to_thread`` (``offload``)."""

    def __init__(self, params: Params, offload: bool) -> None:
        import torch

        super().__init__(params)
        self.torch = torch
        self.offload = offload
        self.how = (
            "await asyncio.to_thread(loss.backward)"
            if offload
            else "loss.backward() inline in the coroutine (blocks the loop)"
        )
        self.params = params
        if params["graph"] == "mlp":
            data = mlp_data(params["widths"], params["batch"])
            self.weights = [torch.tensor(w, requires_grad=True) for w in data.weights]
            self.biases = [torch.tensor(b, requires_grad=True) for b in data.biases]
            self.leaves = self.weights + self.biases
            self.inputs = torch.tensor(data.inputs)
            self.targets = torch.tensor(data.targets)
        else:
            self.x = torch.tensor(_chain_input(), requires_grad=True)
            self.leaves = [self.x]

    def prepare(self) -> None:
        for leaf in self.leaves:
            leaf.grad = None
        if self.params["graph"] == "mlp":
            functional = self.torch.nn.functional
            h = self.inputs
            last = len(self.weights) - 1
            for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
                h = h @ w + b
                if i < last:
                    h = functional.relu(h)
            self.loss = functional.cross_entropy(h, self.targets)
        else:
            h = self.x
            for _ in range(self.params["n"]):
                h = h * CHAIN_FACTOR
            self.loss = h.sum()

    async def backward(self) -> float:
        if self.offload:
            await asyncio.to_thread(self.loss.backward)
        else:
            self.loss.backward()  # on the loop's thread: nothing else runs meanwhile
        return float(self.leaves[0].grad.sum())


class _NumpyStall(_StallCase):
    """The hand-written NumPy backward, inline in the coroutine (blocks the loop), or in
    ``asyncio.to_thread`` (``offload``: the floor for a backward off the loop on the same
    OpenBLAS, with no engine at all)."""

    def __init__(self, params: Params, offload: bool = False) -> None:
        super().__init__(params)
        self.params = params
        self.offload = offload
        self.how = (
            "hand-written NumPy backward in asyncio.to_thread (no engine)"
            if offload
            else "hand-written NumPy backward inline in the coroutine (blocks the loop)"
        )
        if params["graph"] == "mlp":
            self.data = mlp_data(params["widths"], params["batch"])
            self.rows = np.arange(params["batch"])

    def prepare(self) -> None:
        if self.params["graph"] != "mlp":
            return
        data = self.data
        self.activations = [data.inputs]
        h = data.inputs
        last = len(data.weights) - 1
        for i, (w, b) in enumerate(zip(data.weights, data.biases, strict=True)):
            h = h @ w
            h += b
            if i < last:
                np.maximum(h, 0.0, out=h)
                self.activations.append(h)
        h -= h.max(axis=1, keepdims=True)
        probs = np.exp(h)
        probs /= probs.sum(axis=1, keepdims=True)
        self.probs = probs

    async def backward(self) -> float:
        if self.offload:
            return await asyncio.to_thread(self._backward)
        return self._backward()

    def _backward(self) -> float:
        if self.params["graph"] != "mlp":
            grad = np.ones(4, np.float32)
            for _ in range(self.params["n"]):
                grad = grad * np.float32(CHAIN_FACTOR)
            return float(grad.sum())
        weights = self.data.weights
        grad = self.probs.copy()
        grad[self.rows, self.data.targets] -= 1.0
        grad /= grad.shape[0]
        weight_grads: list[np.ndarray] = []
        for i in range(len(weights) - 1, -1, -1):
            weight_grads.append(self.activations[i].T @ grad)
            grad.sum(axis=0)  # the bias gradient
            if i > 0:
                grad = grad @ weights[i].T
                grad *= self.activations[i] > 0
        return float(weight_grads[-1].sum())


class _IdleStall(_StallCase):
    """No backward: the loop sleeps for ``idle_s``; the heartbeat's own jitter (the floor)."""

    how = "asyncio.sleep (no backward: the heartbeat's floor)"

    def __init__(self, params: Params) -> None:
        super().__init__(params)
        self.idle_s = params["idle_s"]

    async def backward(self) -> float:
        await asyncio.sleep(self.idle_s)
        return 0.0


def _chain_input() -> np.ndarray:
    return np.random.default_rng(0).standard_normal(4).astype(np.float32)


def _stall_summary(lines: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], str]:
    summary = {
        name: {
            key: line[key]
            for key in (
                "median_s",
                "tick_max_ms",
                "tick_p99_ms",
                "tick_p50_ms",
                "run_max_median_ms",
                "ticks",
                "gc2_in_window",
            )
        }
        for name, line in lines.items()
    }
    rows = [
        "| implementation | how the backward runs | backward (median) | longest tick delay "
        "| p99 | p50 | median of per-run longest | ticks | full GCs in windows (longest) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, line in lines.items():
        rows.append(
            f"| {name} | {line['backward']} | {format_seconds(line['median_s'])} "
            f"| {_format_ms(line['tick_max_ms'])} | {_format_ms(line['tick_p99_ms'])} "
            f"| {_format_ms(line['tick_p50_ms'])} | {_format_ms(line['run_max_median_ms'])} "
            f"| {line['ticks']} | {line['gc2_in_window']}"
            + (f" ({_format_ms(line['gc2_max_ms'])})" if line["gc2_in_window"] else "")
            + " |"
        )
    return summary, "\n".join(rows)


_STALL_IMPLS = (
    Impl(SUBJECT, _AioStall),
    Impl("torch", lambda params: _TorchStall(params, offload=False), ("torch",)),
    Impl("numpy", _NumpyStall),
    Impl(
        "torch-to_thread",
        lambda params: _TorchStall(params, offload=True),
        ("torch",),
        main_table=False,
    ),
    Impl(
        "numpy-to_thread",
        lambda params: _NumpyStall(params, offload=True),
        main_table=False,
    ),
    Impl("idle", _IdleStall, main_table=False),
)
# The MLP's backward is BLAS-bound: with one BLAS thread, a core stays free for the loop.
_STALL_MLP_IMPLS = (
    *_STALL_IMPLS[:3],
    Impl(
        f"{SUBJECT}-nice10",
        lambda params: _AioStall(params, worker_nice=10),
        main_table=False,
    ),
    Impl(
        f"{SUBJECT}-1blas",
        lambda params: _AioStall(params, blas_threads=1),
        ("threadpoolctl",),
        main_table=False,
    ),
    *_STALL_IMPLS[3:],
)
# The chain's backward is GIL-bound: the loop's thread gets the GIL back when the worker
# holding it is made to drop it, after the switch interval (5 ms by default).
_STALL_CHAIN_IMPLS = (
    *_STALL_IMPLS[:3],
    Impl(
        f"{SUBJECT}-switch0.5ms",
        lambda params: _AioStall(params, switch_interval_s=0.0005),
        main_table=False,
    ),
    *_STALL_IMPLS[3:],
)

_HEARTBEAT = {"period_s": 0.001}

register(
    Workload(
        name="stall",
        description="1 ms heartbeat on the loop during backward of the MLP 784-1024-1024-10, "
        "batch 256: tick delays",
        sizes={
            size: {"graph": "mlp"} | MLP_SIZES[size] | _HEARTBEAT | {"idle_s": idle_s}
            for size, idle_s in (("full", 0.02), ("quick", 0.02), ("tiny", 0.002))
        },
        repeats={"full": (3, 30), "quick": (1, 8), "tiny": (0, 1)},
        impls=_STALL_MLP_IMPLS,
        summary=_stall_summary,
    )
)

register(
    Workload(
        name="stall_chain",
        description="1 ms heartbeat on the loop during backward of the 10,000-op chain: "
        "tick delays",
        sizes={
            "full": {"graph": "chain", "n": 10_000} | _HEARTBEAT | {"idle_s": 0.05},
            "quick": {"graph": "chain", "n": 2_000} | _HEARTBEAT | {"idle_s": 0.02},
            "tiny": {"graph": "chain", "n": 10} | _HEARTBEAT | {"idle_s": 0.002},
        },
        repeats={"full": (2, 20), "quick": (1, 5), "tiny": (0, 1)},
        impls=_STALL_CHAIN_IMPLS,
        summary=_stall_summary,
    )
)
