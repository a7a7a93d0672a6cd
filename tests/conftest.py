"""Shared fixtures: devices to parametrize over and the optional PyTorch oracle."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import aioautograd as ag


def _devices() -> list[Any]:
    devices: list[Any] = ["cpu", "sim:1"]
    try:
        from aioautograd.devices import cuda

        has_gpu = cuda.is_available()
    except Exception:
        has_gpu = False
    devices.append(
        pytest.param(
            "cuda:0",
            marks=pytest.mark.skipif(not has_gpu, reason="CuPy with a visible GPU is required"),
        )
    )
    return devices


@pytest.fixture(params=_devices())
def device(request: pytest.FixtureRequest) -> str:
    """Each device a test should run on: ``cpu`` and the simulated ``sim:1`` always,
    ``cuda:0`` when CuPy sees a GPU."""
    return str(request.param)


@pytest.fixture
def torch() -> Any:
    """PyTorch as an oracle (``pip install torch==2.13.0``); tests using it skip without it."""
    return pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _seed() -> None:
    ag.manual_seed(0)
    np.random.seed(0)


@pytest.fixture
def executors_only() -> Iterator[None]:
    """Run every node on the executors: the default engine's inline budget is 0 meanwhile
    (by default small CPU nodes of an awaited backward run on the loop's thread)."""
    from aioautograd.engine import get_default_engine

    engine = get_default_engine()
    saved = engine.inline_budget_s
    engine.inline_budget_s = 0
    yield
    engine.inline_budget_s = saved
