"""The benchmark workloads run (at their tiny size) and give finite losses; no timing here."""

from __future__ import annotations

import math

import pytest

from benchmarks import harness
from benchmarks.harness import markdown_table, run_case
from benchmarks.workloads import REGISTRY, SUBJECT, Impl, mlp_data

# The optional third-party baselines are exercised by `benchmarks/run.py` itself.
_CHECKED = (SUBJECT, "numpy", "torch")

_CASES = [
    pytest.param(workload, impl, id=f"{workload.name}-{impl.name}")
    for workload in REGISTRY.values()
    for impl in workload.impls
    if impl.name in _CHECKED
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("workload", "impl"), _CASES)
async def test_workload_runs(workload, impl: Impl) -> None:
    for module in impl.needs:
        pytest.importorskip(module)
    case = impl.factory(workload.sizes["tiny"])
    assert math.isfinite(await run_case(case))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["mlp", "small_mlp"])
async def test_mlp_step_matches_numpy(name: str) -> None:
    # Same weights, batch and loss: two SGD steps of aioautograd and of the hand-written
    # NumPy baseline agree, so the figures compare the same computation.
    impls = {impl.name: impl for impl in REGISTRY[name].impls}
    params = REGISTRY[name].sizes["tiny"]
    subject, baseline = impls[SUBJECT].factory(params), impls["numpy"].factory(params)
    for _ in range(2):
        assert await run_case(subject) == pytest.approx(await run_case(baseline), rel=1e-4)


def test_mlp_data_is_deterministic() -> None:
    first, second = mlp_data([4, 3, 2], batch=5), mlp_data([4, 3, 2], batch=5)
    assert (first.weights[0] == second.weights[0]).all()
    assert first.one_hot.sum() == 5


@pytest.mark.timeout(30)
@pytest.mark.parametrize("interleave", [False, True])
async def test_measure_and_table(interleave: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "MIN_WARMUP_S", 0.0)
    workload = REGISTRY["chain"]
    impl = next(i for i in workload.impls if i.name == SUBJECT)
    cases = {SUBJECT: impl.factory(workload.sizes["tiny"])}
    (result,) = await harness.measure("chain", cases, 0, 2, interleave)
    assert result.repeats == 2
    assert result.as_json()["per_node_us"] >= 0
    assert "| chain |" in markdown_table({"chain": [result]})
