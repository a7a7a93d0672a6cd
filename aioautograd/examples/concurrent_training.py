"""Flagship example: several models trained at once on one engine with ``asyncio.gather``.

Each model is an MLP classifying interleaved spirals with its own optimizer. Each training
step (forward, loss, backward, optimizer step) runs on the engine's CPU executor through
``aioautograd.offload``, so the event loop only coordinates, and the engine's CPU budget
shares the cores between the four models (no BLAS oversubscription). The same training is
then run one model after another, both ways (the whole step offloaded, and natural code with
the forward on the loop), and the speed-up is taken over the faster of the two. Loss curves
and the engine timeline (one colour per model) are written as PNG files.

Run with ``make demo`` or ``python -m aioautograd.examples.concurrent_training``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aioautograd as ag
from aioautograd import nn, optim
from aioautograd.examples.data import make_spirals
from aioautograd.nn import functional as F
from aioautograd.profiler import profile, record_function


@dataclass
class Run:
    """One model, its optimizer and its loss history."""

    name: str
    model: nn.Module
    optimizer: optim.Optimizer
    losses: list[float] = field(default_factory=list)


WARMUP_STEPS = 3


def make_runs(hidden: int, seed: int) -> list[Run]:
    ag.manual_seed(seed)
    configs: list[tuple[str, Callable[[Any], optim.Optimizer]]] = [
        ("adam", lambda p: optim.Adam(p, lr=3e-3)),
        ("adamw", lambda p: optim.AdamW(p, lr=3e-3)),
        ("sgd-momentum", lambda p: optim.SGD(p, lr=0.1, momentum=0.9)),
        ("sgd-nesterov", lambda p: optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True)),
    ]
    runs = []
    for name, make_optimizer in configs:
        model = nn.Sequential(
            nn.Linear(2, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 3),
        )
        runs.append(Run(name, model, make_optimizer(model.parameters())))
    return runs


def training_step(run: Run, x: ag.Tensor, y: ag.Tensor) -> float:
    """One step, as plain code: ``aioautograd.offload`` runs it on the engine's executor."""
    loss = F.cross_entropy(run.model(x), y)
    run.optimizer.zero_grad()
    loss.backward_sync()
    run.optimizer.step()
    return float(loss.item())


async def train_one(
    run: Run, x: ag.Tensor, y: ag.Tensor, steps: int, bar: Any, offload: bool = True
) -> None:
    with record_function(run.name):  # the timeline draws this model's nodes in one colour
        for _ in range(steps):
            if offload:
                value = await ag.offload(training_step, run, x, y)
            else:  # natural code: forward and step on the loop, backward awaited
                loss = F.cross_entropy(run.model(x), y)
                run.optimizer.zero_grad()
                await loss.backward()
                run.optimizer.step()
                value = loss.item()
            run.losses.append(value)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{value:.3f}")


def _bars(runs: list[Run], steps: int, enabled: bool) -> list[Any]:
    if not enabled:
        return [None for _ in runs]
    from tqdm import tqdm

    return [
        tqdm(total=steps, desc=f"{run.name:>12}", position=i, leave=True, ncols=80)
        for i, run in enumerate(runs)
    ]


async def train(steps: int, hidden: int, output: Path, progress: bool) -> dict[str, Any]:
    x, y = make_spirals(400, 3, seed=0)

    # Untimed warm-up on throwaway models, both ways: the engine's threads, the BLAS library
    # and every first call start here, not inside whichever schedule is timed first (on a
    # fresh install the first `make demo` printed x1.17, later ones x1.37-1.39).
    warm_runs = make_runs(hidden, seed=2)
    await asyncio.gather(*(train_one(run, x, y, WARMUP_STEPS, None) for run in warm_runs))
    for run in warm_runs:
        await train_one(run, x, y, WARMUP_STEPS, None, offload=False)

    runs = make_runs(hidden, seed=1)
    bars = _bars(runs, steps, progress)
    start = time.perf_counter()
    with profile() as prof:
        await asyncio.gather(
            *(train_one(run, x, y, steps, bar) for run, bar in zip(runs, bars, strict=True))
        )
    concurrent_s = time.perf_counter() - start
    for bar in bars:
        if bar is not None:
            bar.close()

    # The same training one model at a time, in the default environment, both ways; the
    # speed-up is taken over the faster sequential schedule.
    sequential: dict[str, float] = {}
    sequential_losses: dict[str, dict[str, float]] = {}
    for name, offload in (("offloaded steps", True), ("natural code", False)):
        sequential_runs = make_runs(hidden, seed=1)
        start = time.perf_counter()
        for run in sequential_runs:
            await train_one(run, x, y, steps, None, offload=offload)
        sequential[name] = time.perf_counter() - start
        sequential_losses[name] = {run.name: run.losses[-1] for run in sequential_runs}
    best_name = min(sequential, key=sequential.__getitem__)
    best_s = sequential[best_name]

    accuracies = {}
    with ag.no_grad():
        for run in runs:
            accuracies[run.name] = float((run.model(x).argmax(1) == y).numpy().mean())
    print()
    for run in runs:
        print(
            f"{run.name:>12}: final loss {run.losses[-1]:.4f}, accuracy {accuracies[run.name]:.1%}"
        )
    threads = len({e.thread for e in prof.events})
    print(
        f"concurrent: {concurrent_s:.2f} s; one after another: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in sequential.items())
        + f"; speed-up over the best sequential ({best_name}): x{best_s / concurrent_s:.2f} "
        f"({len(prof.events)} nodes on {threads} threads)"
    )
    await asyncio.to_thread(_write_figures, runs, prof, output)
    return {
        "losses": {run.name: run.losses[-1] for run in runs},
        "first_losses": {run.name: run.losses[0] for run in runs},
        # Final losses of the same training one model at a time: equal to the concurrent ones.
        "sequential_losses": sequential_losses,
        "accuracies": accuracies,
        "speedup": best_s / concurrent_s,
        "sequential_s": sequential,
        "concurrent_s": concurrent_s,
    }


def _write_figures(runs: list[Run], prof: profile, output: Path) -> None:
    output.mkdir(parents=True, exist_ok=True)
    _plot_losses(runs, output / "loss_curves.png")
    events = prof.events
    origin = min(event.start_ns for event in events) if events else 0
    middle = (max(event.end_ns for event in events) - origin) / 2e6 if events else 0.0
    prof.plot_timeline(
        str(output / "engine_timeline.png"),
        title=f"{len(runs)} models trained concurrently",
        zoom_ms=(middle, middle + 10.0),  # 10 ms from the middle of the run
    )
    print(f"wrote {output / 'loss_curves.png'} and {output / 'engine_timeline.png'}")


def _plot_losses(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for run in runs:
        axes.plot(run.losses, label=run.name)
    axes.set_yscale("log")
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy loss")
    axes.set_title("models trained concurrently on one engine")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--output", type=Path, default=Path("demo_output"))
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.run(train(args.steps, args.hidden, args.output, not args.no_progress))
    except ImportError:
        asyncio.run(train(args.steps, args.hidden, args.output, not args.no_progress))


if __name__ == "__main__":
    main()
