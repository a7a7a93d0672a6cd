"""``benchmarks/rpc.py`` runs (at its quick size) on both backends; no timing is checked."""

from __future__ import annotations

import json

import pytest

from benchmarks import rpc as bench

pytestmark = pytest.mark.timeout(60)


async def test_rpc_benchmark_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    # Shrink the 8 MB payload so the smoke run stays quick; the code path is the same.
    monkeypatch.setitem(bench.SIZES, "8MB", (64 * 1024, 10, 10, 2))
    results = await bench._run_local(quick=True) + await bench._run_grpc(quick=True)
    assert {(r["name"], r["backend"]) for r in results} == {
        (name, backend)
        for name in ("rpc_latency", "rpc_throughput")
        for backend in ("local", "grpc")
    }
    assert all(r.get("median_us", 1) > 0 and r.get("calls_per_s", 1) > 0 for r in results)
    assert "| small | grpc |" in bench.markdown_table(results)


def test_round_trip_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    # benchmarks/rpc_roundtrip.py: every implementation, a few calls each, and the in-process
    # mode (what callgrind counts); the figures are counted per call on both sides.
    from benchmarks import rpc_roundtrip

    argv = ["--impl", "bare,bare-tasks,ours", "--calls", "5", "--warmup", "2"]
    assert rpc_roundtrip.main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    results = [json.loads(line) for line in lines]
    assert {(r["impl"], r["payload"]) for r in results} == {
        (impl, payload)
        for impl in ("bare", "bare-tasks", "ours")
        for payload in rpc_roundtrip.PAYLOADS
    }
    for r in results:
        assert r["median_us"] > 0
        assert r["client"]["loop_iterations"] > 0
        assert r["server"]["loop_iterations"] > 0
    assert next(r for r in results if r["payload"] == "step")["bytes"] >= 600 * 64 * 4
    assert rpc_roundtrip.main(["--inprocess", "small", "--calls", "3"]) == 0
