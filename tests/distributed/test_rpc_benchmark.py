"""``benchmarks/rpc.py`` runs (at its quick size) on both backends; no timing is checked."""

from __future__ import annotations

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
