"""The examples run and learn (short runs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import aioautograd as ag
from aioautograd.examples import concurrent_training, demo

ROOT = Path(__file__).resolve().parents[2]


async def test_demo_training_reduces_loss() -> None:
    final_loss = await demo.train(steps=60)
    assert final_loss < 0.5


async def test_concurrent_training_learns_and_writes_figures(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = await concurrent_training.train(steps=40, hidden=64, output=tmp_path, progress=False)
    assert set(result["losses"]) == {"adam", "adamw", "sgd-momentum", "sgd-nesterov"}
    assert all(acc > 0.5 for acc in result["accuracies"].values())
    assert (tmp_path / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "engine_timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert result["speedup"] > 0


def test_concurrent_runs_are_independent_of_scheduling() -> None:
    # Same seeds, same data: each model's trajectory does not depend on the others.
    runs_a = concurrent_training.make_runs(8, seed=3)
    runs_b = concurrent_training.make_runs(8, seed=3)
    for a, b in zip(runs_a, runs_b, strict=True):
        for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
            assert (p.detach().numpy() == q.detach().numpy()).all()
    assert isinstance(runs_a[0].model(ag.randn(2, 2)), ag.Tensor)


def test_demo_module_runs_as_a_script() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "aioautograd.examples.demo", "--steps", "10"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "step   10" in result.stdout


async def test_model_parallel_example_matches_single_process_on_local_backend() -> None:
    from aioautograd.examples import model_parallel

    losses = await model_parallel.main_local(steps=8)
    assert losses is not None
    assert len(losses) == 8
    reference = await model_parallel.train_single_process(8, seed=1)
    assert losses == pytest.approx(reference, rel=1e-12, abs=1e-12)
    assert losses[-1] < losses[0]


def test_model_parallel_example_over_grpc_with_the_launcher() -> None:
    # The README's command: under the launcher the example uses its grpc backend by itself.
    pytest.importorskip("grpc")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "aioautograd.distributed.run",
            "--nproc",
            "2",
            "-m",
            "aioautograd.examples.model_parallel",
            "--steps",
            "6",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "grpc backend, 6 steps" in result.stdout
    assert "largest difference from single-process training: 0.00e+00" in result.stdout
