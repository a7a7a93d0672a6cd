"""The benchmark workloads run (at their tiny size) and give finite losses; no timing here."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from benchmarks import blas_exactness, harness, mlp_parts
from benchmarks import model_parallel as model_parallel_script
from benchmarks.concurrency import Heartbeat
from benchmarks.distributed import AWAKE, LOCAL, torch_rpc_unavailable
from benchmarks.harness import markdown_table, run_case
from benchmarks.model_parallel_workers import torch_backend_options
from benchmarks.workloads import REGISTRY, SUBJECT, Case, Impl, mlp_data

# The optional third-party baselines are exercised by `benchmarks/run.py` itself; variants
# of these ("aioautograd-seq", "torch-threads", ...) are checked too.
_CHECKED = (SUBJECT, "numpy", "torch")


def _checked(name: str) -> bool:
    return any(name == base or name.startswith(f"{base}-") for base in _CHECKED)


# `model_parallel` starts worker processes per case; test_model_parallel_workload runs it.
_CASES = [
    pytest.param(workload, impl, id=f"{workload.name}-{impl.name}")
    for workload in REGISTRY.values()
    for impl in workload.impls
    if _checked(impl.name) and workload.name != "model_parallel"
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("workload", "impl"), _CASES)
async def test_workload_runs(workload, impl: Impl) -> None:
    reason = impl.skip_reason()  # a missing module, or no GPU for the gpu_mlp figure
    if reason is not None:
        pytest.skip(reason)
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


@pytest.mark.timeout(60)
async def test_mlp_parts_steps_are_the_workload_steps(capsys: pytest.CaptureFixture[str]) -> None:
    # mlp_parts.py times copies of the two `mlp` steps with marks in them: after one step
    # each, the parameters equal those after one step of the workloads' own cases.
    parts = mlp_parts._Parts()
    await parts.aio_step(time.perf_counter)
    parts.numpy_step(time.perf_counter)
    impls = {impl.name: impl for impl in REGISTRY["mlp"].impls}
    subject, baseline = (
        impls[SUBJECT].factory(mlp_parts.PARAMS),
        impls["numpy"].factory(mlp_parts.PARAMS),
    )
    await run_case(subject)
    await run_case(baseline)
    for mine, theirs in zip(parts.aio.params, subject.params, strict=True):
        assert np.array_equal(mine.data, theirs.data)
    # (the NumPy side's products may run on a different BLAS thread count: not bitwise)
    ours, workloads_own = parts.np, baseline
    for mine, theirs in zip(
        ours.weights + ours.biases, workloads_own.weights + workloads_own.biases, strict=True
    ):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-7)
    await mlp_parts.products(steps=2)
    out = capsys.readouterr().out
    assert "aioautograd" in out
    assert "numpy" in out
    assert "outside" in out
    await mlp_parts.handoffs(rounds=1, gated=False)
    out = capsys.readouterr().out
    assert "pauses" in out
    assert "to worker" in out  # the products ran on the engine's workers, not inline


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


class _Logged(Case):
    """A case that logs its runs and times itself: run ``k`` of a case lasts ``k`` seconds."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log, self.runs = name, log, 0

    def run(self) -> float:
        self.runs += 1
        self.log.append(self.name)
        self.timed_s = float(self.runs)
        return 1.0


@pytest.mark.timeout(30)
async def test_interleaved_rounds_time_each_case_after_a_run_of_its_own() -> None:
    # Each case's timed runs follow a run of the same case (its untimed re-warming run, or
    # its previous timed run), never another implementation's.
    log: list[str] = []
    cases: dict[str, Case] = {name: _Logged(name, log) for name in ("a", "b", "c")}
    repeats = harness.INTERLEAVE_TIMED + 2
    results = await harness.measure("logged", cases, 1, repeats, interleave=True)
    assert all(r.repeats == repeats for r in results)
    timed = harness.INTERLEAVE_TIMED
    warm_runs = 1 + timed  # one warm-up round: its untimed run, then `timed` warm-up runs
    rounds = math.ceil(repeats / timed)
    for result in results:
        case = cases[result.impl]
        assert isinstance(case, _Logged)
        assert case.runs == warm_runs + rounds + repeats
        assert result.max_s == case.runs  # the last run was timed
        assert result.min_s == warm_runs + 2  # the first timed run follows an untimed one
        assert result.median_s != warm_runs + timed + 2  # round 3's untimed run was not timed
    # Each round's block for a case: consecutive runs of that case only.
    blocks = [name for i, name in enumerate(log) if i == 0 or log[i - 1] != name]
    assert len(blocks) == 3 * (1 + rounds)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["concurrent", "concurrent_mid", "stall", "stall_chain"])
async def test_summary_workloads(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The aioautograd side of the concurrency figures, measured once at the tiny size, with
    # their JSON summary and table (no timing assertions).
    pytest.importorskip("threadpoolctl")
    monkeypatch.setattr(harness, "MIN_WARMUP_S", 0.0)
    workload = REGISTRY[name]
    impls = {impl.name for impl in workload.impls if impl.name.startswith(SUBJECT)}
    results, table = await harness.run_workload(workload, "tiny", impls)
    assert {r.impl for r in results} == impls
    assert all(math.isfinite(r.first_value) for r in results)
    assert table is not None
    assert "| aioautograd |" in table
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    (summary,) = [line["summary"] for line in lines if "summary" in line]
    if name.startswith("concurrent"):
        # Same initial weights and batches: the schedule does not change the losses.
        values = {r.first_value for r in results}
        assert max(values) - min(values) <= 1e-4 * max(abs(v) for v in values)
        assert summary["speedup_natural"] > 0
        assert summary["speedup_offload"] > 0
    else:
        assert summary[SUBJECT]["ticks"] >= 1
        assert summary[SUBJECT]["tick_max_ms"] >= 0
    # Variants have no column of their own in the main table.
    assert "aioautograd-" not in markdown_table({name: results}).splitlines()[0]


async def test_heartbeat_sees_a_blocked_loop() -> None:
    heartbeat = Heartbeat(0.001)
    heartbeat.start()
    await asyncio.sleep(0.003)
    start = time.perf_counter()
    time.sleep(0.02)  # blocks the loop, as an inline backward would  # noqa: ASYNC251
    end = time.perf_counter()
    await heartbeat.stop()
    assert max(heartbeat.delays_s(start, end)) >= 0.015


def _torch_rpc_skip_reason() -> str | None:
    try:
        import torch  # noqa: F401
    except ImportError:
        return "torch is not installed"
    return torch_rpc_unavailable()


@pytest.mark.timeout(90)
async def test_model_parallel_workload(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The worlds (aioautograd over grpc and over local, torch.distributed.rpc) run their
    # worker processes for three steps at the tiny size: same initial weights and data, so
    # the losses agree (aioautograd's exactly, torch's to float32 rounding). The torch-uv
    # variant differs from torch only by its TensorPipe options (checked below): a torch
    # world takes ~6 s to start and stop, so it is left to the benchmark itself. The awake
    # variant (GrpcOptions.keep_awake_s) computes the same steps.
    pytest.importorskip("grpc")
    monkeypatch.setattr(harness, "MIN_WARMUP_S", 0.0)
    impls = {SUBJECT, AWAKE, LOCAL, "torch"}
    results, table = await harness.run_workload(REGISTRY["model_parallel"], "tiny", impls)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    skipped = {line["impl"]: line["skipped"] for line in lines if "skipped" in line}
    torch_reason = _torch_rpc_skip_reason()
    assert ("torch" in skipped) == (torch_reason is not None)
    expected = impls - skipped.keys()
    assert {r.impl for r in results} == expected
    assert all(r.repeats == 2 and r.extras["steps_run"] == 3 for r in results)
    assert all((r.extras["cpu_s_per_step"] or 0.0) >= 0.0 for r in results)
    (summary,) = [line["summary"] for line in lines if "summary" in line]
    gaps = summary["loss_difference"]
    assert gaps[SUBJECT] == {"max_abs": 0.0, "steps": 3, "against": LOCAL}
    assert gaps[AWAKE] == {"max_abs": 0.0, "steps": 3, "against": LOCAL}
    if torch_reason is None:
        assert gaps["torch"]["steps"] == 3
        assert gaps["torch"]["max_abs"] <= 1e-5
        assert summary["grpc_over_torch"] > 0
        assert summary["local_over_torch"] > 0
    assert table is not None
    assert "| aioautograd-local | local | 1 |" in table
    # Only the subject and torch are columns of the main table.
    assert LOCAL not in markdown_table({"model_parallel": results}).splitlines()[0]


def test_model_parallel_torch_options() -> None:
    if _torch_rpc_skip_reason() is not None:
        pytest.skip(_torch_rpc_skip_reason())
    # (torch does not expose the transports it was given; the benchmark's CPU figures show
    # the difference: no busy-polling with uv.)
    for backend in ("torch", "torch-uv"):
        assert torch_backend_options(backend).init_method == "env://"


@pytest.mark.timeout(60)
async def test_model_parallel_script(capsys: pytest.CaptureFixture[str]) -> None:
    # benchmarks/model_parallel.py's own step counts, on the one-process world only.
    table = await model_parallel_script.measure(3, 1, 3, {LOCAL})
    (line,) = [json.loads(text) for text in capsys.readouterr().out.splitlines()[:1]]
    assert line["impl"] == LOCAL
    assert line["repeats"] == 2
    assert line["warmup"] == 1
    assert table is not None
    assert "0 (3 steps)" in table


@pytest.mark.timeout(60)
def test_model_parallel_profile_script() -> None:
    # benchmarks/model_parallel_profile.py on the local backend (its own process: it counts
    # the iterations of the loop it runs on), a few steps; no timing checked.
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "model_parallel_profile.py"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run(
        [sys.executable, str(script), "--steps", "3", "--warmup", "1"],
        capture_output=True,
        text=True,
        timeout=50,
        env=env,
        check=True,
    )
    (line,) = [json.loads(text) for text in done.stdout.splitlines() if text.startswith("{")]
    assert line["backend"] == "local"
    assert line["steps"] == 3
    assert set(line["phase_median_us"]) == {
        "first_layer",
        "forward_rpc",
        "loss",
        "backward",
        "optimizer",
        "release",
    }
    assert all(value > 0 for value in line["phase_median_us"].values())
    assert set(line["phase_loop_cpu_us"]) == set(line["phase_median_us"])
    assert line["phase_loop_cpu_us"]["first_layer"] > 0  # NumPy on the loop's thread
    assert line["phase_loop_iterations"]["forward_rpc"] > 0  # the call waits for the loop
    counts = line["per_step"]["process"]
    assert counts["cpu_ms"] > 0
    assert counts["loop_iterations"] > 0
    assert counts["tasks"] > 0
    assert counts["minor_faults"] >= 0
    assert counts["context_switches"] >= 0
    threads = counts["threads_cpu_ms"]
    assert threads["loop"] > 0
    assert sum(threads.values()) <= counts["cpu_ms"] * 1.5  # the same CPU, read twice


def test_blas_exactness_agrees_with_the_budget_s_probe() -> None:
    # The script's cuts at 64 (both ways) and at 12 rows of a 128x16 @ 16x128 float32
    # product ask what the budget's probes ask (other data and shapes): whether this BLAS
    # cuts float32 products exactly both ways at 64, and along rows at multiples of 12.
    from aioautograd.devices.cpu_budget import _blocks_are_exact, _row_blocks_are_exact

    result = blas_exactness.check(np.float32, (128, 16, 128), np.random.default_rng(5))
    cuts = {f"{way}@{at}" for way in ("rows", "cols") for at in (12, 16, 48, 64, 96)}
    assert set(result) == cuts | {"2 threads"}
    assert all(isinstance(value, bool) for value in result.values())
    exact = _blocks_are_exact(np.dtype(np.float32))
    assert (result["rows@64"] and result["cols@64"]) == exact
    assert result["rows@12"] == _row_blocks_are_exact(np.dtype(np.float32))


def test_async_app_ab_settings_name_policy_fields() -> None:
    pytest.importorskip("aiohttp")
    from benchmarks import async_app_ab

    name, fields = async_app_ab._parse_setting("short:gil_hold_s=0.0005,gil_pause_always=1")
    policy = async_app_ab._policy(fields)
    assert name == "short"
    assert policy.gil_hold_s == 0.0005
    assert policy.gil_pause_always is True
    assert policy.cpu_threads is None  # untouched fields keep their defaults
    assert async_app_ab._policy({"cpu_threads": "2", "intra_op": "blas"}).cpu_threads == 2


def test_inline_limits_finds_the_largest_inline_node() -> None:
    from aioautograd.engine import EnginePolicy
    from benchmarks import inline_limits

    # A ReLU reads and writes rows x 64 elements each: the largest that fits the limit.
    limit = EnginePolicy().inline_max_elements
    rows = inline_limits.largest_inline("relu", "float32")
    assert 2 * rows * inline_limits.WIDTH <= limit < 2 * (rows + 1) * inline_limits.WIDTH
    assert inline_limits.largest_inline("gelu", "float32") * 64 <= rows  # GELU's weight
    results = inline_limits.limits(runs=1)
    assert {line["node"] for line in results} >= {"GeluBackward0", "LinearFunctionBackward0"}
    assert all(line["min_us"] > 0 for line in results)


async def test_inline_limits_heartbeat() -> None:
    from benchmarks import inline_limits

    result = await inline_limits.heartbeat(passes=2)
    assert result["ticks"] > 0
    assert result["tick_max_ms"] >= result["tick_p99_ms"]


def test_late_ticks_attributes_every_late_tick() -> None:
    from benchmarks import late_ticks

    assert late_ticks.attribute(2.0, 1.2, 0.1, 0.0) == "run queue"
    assert late_ticks.attribute(2.0, 0.2, 1.0, 0.0) == "loop callbacks"
    assert late_ticks.attribute(2.0, 0.2, 0.1, 1.5) == "gc"
    assert late_ticks.attribute(2.0, 0.9, 0.9, 0.1) == "other"
    # Its own process: the script patches the budget's NumPy and the loop's callbacks.
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "late_ticks.py"
    done = subprocess.run(
        [sys.executable, str(script), "--runs", "1", "--size", "tiny", "--threshold", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(script.parent.parent)},
    )
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()[:2]
    ticks = int(first.split(": ")[1].split(" ticks")[0])
    late = int(first.split("; ")[1].split(" later")[0])
    assert ticks == late > 0  # (threshold 0: every tick)
    causes = json.loads(second.split(": ", 1)[1].split("; ")[0].replace("'", '"'))
    assert sum(causes.values()) == late


def test_async_app_other_cores_is_the_machine_less_server_and_driver() -> None:
    pytest.importorskip("aiohttp")
    from benchmarks.async_app import CpuSnapshot, other_cores

    before = CpuSnapshot(wall_s=10.0, machine_s=100.0, driver_s=5.0, server_s=20.0)
    # 2 s: the machine used 3.6 CPU-seconds, the driver 0.4, the server 1.8: 1.4 s others.
    after = CpuSnapshot(wall_s=12.0, machine_s=103.6, driver_s=5.4, server_s=21.8)
    assert other_cores(before, after) == 0.7
    # Tick rounding can make the difference slightly negative: never below zero.
    assert other_cores(before, CpuSnapshot(12.0, 101.0, 5.6, 21.0)) == 0.0
    # Where /proc/stat or the server's stat cannot be read, or no time passed: unknown.
    assert other_cores(CpuSnapshot(10.0, None, 5.0, 20.0), after) is None
    assert other_cores(before, CpuSnapshot(12.0, 103.6, 5.4, None)) is None
    assert other_cores(before, CpuSnapshot(10.0, 103.6, 5.4, 21.8)) is None


def test_async_app_cpu_snapshot_counts_this_process() -> None:
    pytest.importorskip("aiohttp")
    from benchmarks.async_app import cpu_snapshot, machine_cpu_s

    before = cpu_snapshot(None)
    # 0.2 s of CPU: os.times() counts user and system time in whole clock ticks (10 ms)
    # each, so the snapshot may see up to 20 ms less than process_time.
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:  # spend CPU in the driver
        pass
    after = cpu_snapshot(None)
    assert after.driver_s - before.driver_s >= 0.17
    assert after.wall_s > before.wall_s
    if machine_cpu_s() is not None:  # Linux: the machine's count includes this process's
        assert before.machine_s is not None
        assert after.machine_s is not None
        assert after.machine_s - before.machine_s >= 0.1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("interleave", [True, False])
async def test_fan_pairs_count_the_kept_runs_only(
    interleave: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The paired fan / chain ratio: one pair per timed repeat (warm-up runs and an
    # interleaved round's re-warming run left out), and its figures in the fan's summary.
    monkeypatch.setattr(harness, "MIN_WARMUP_S", 0.0)
    workload = REGISTRY["fan"]
    monkeypatch.setitem(workload.repeats, "tiny", (2, 7))
    results, table = await harness.run_workload(
        workload, "tiny", {SUBJECT, f"{SUBJECT}-paired"}, interleave
    )
    lines = {
        line["impl"]: line
        for line in map(json.loads, capsys.readouterr().out.splitlines())
        if "impl" in line
    }
    paired = lines[f"{SUBJECT}-paired"]
    assert paired["pairs"] == 7
    assert paired["pair_ratio_min"] <= paired["pair_ratio_median"] <= paired["pair_ratio_max"]
    assert 0 <= paired["pairs_within_1_5x"] <= 7
    # The same checksum as the plain fan case: the pairs run the same backward.
    assert paired["first_value"] == lines[SUBJECT]["first_value"]
    assert table is not None
    assert f"| {SUBJECT}-paired | " in table
    assert f"| {paired['pairs_within_1_5x']} of 7 |" in table
    assert {r.impl for r in results} == {SUBJECT, f"{SUBJECT}-paired"}
