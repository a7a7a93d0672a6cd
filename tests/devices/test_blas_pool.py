"""OpenBLAS's pool restarted with a short idle spin (``aioautograd.devices.blas_pool``)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from aioautograd.devices import blas_pool

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the pool is restarted on Linux only"
)


class _FakeOpenBlas:
    """The entry points ``shorten_idle_spin`` uses, recording the calls."""

    def __init__(self, timeout: int = 0) -> None:
        self._name = f"fake-openblas-{id(self)}"
        self.timeout = timeout
        self.calls: list[Any] = []
        self.threads = 2
        self.env_read: str | None = None

    def openblas_thread_timeout(self) -> int:
        return self.timeout

    def openblas_read_env(self) -> None:
        self.env_read = os.environ.get("OPENBLAS_THREAD_TIMEOUT")
        self.calls.append("read_env")

    def blas_thread_shutdown_(self) -> None:
        self.calls.append("shutdown")

    def get_threads(self) -> int:
        return self.threads

    def set_threads(self, threads: int) -> None:
        self.threads = threads
        self.calls.append(("threads", threads))


def _shorten(lib: Any) -> str:
    return blas_pool.shorten_idle_spin(lib, lib.get_threads, lib.set_threads, wait_s=0.01)


@linux_only
def test_an_idle_pool_is_restarted_with_the_short_spin_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT", raising=False)
    monkeypatch.delenv("GOTO_THREAD_TIMEOUT", raising=False)
    monkeypatch.setattr(blas_pool, "_native_threads_sleep", lambda deadline: True)
    lib = _FakeOpenBlas()
    assert _shorten(lib) == "shortened"
    # The timeout read with the short value, BLAS on one thread while the pool stops, then
    # the user's count again (which starts the pool); the variable is not left set.
    assert lib.env_read == str(blas_pool.SPIN_LOG2_CYCLES)
    assert lib.calls == ["read_env", ("threads", 1), "shutdown", ("threads", 2)]
    assert "OPENBLAS_THREAD_TIMEOUT" not in os.environ
    assert _shorten(lib) == "shortened"
    assert len(lib.calls) == 4


@linux_only
def test_a_pool_whose_threads_keep_running_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT", raising=False)
    monkeypatch.delenv("GOTO_THREAD_TIMEOUT", raising=False)
    monkeypatch.setattr(blas_pool, "_native_threads_sleep", lambda deadline: False)
    lib = _FakeOpenBlas()
    assert _shorten(lib) == "busy"
    assert "shutdown" not in lib.calls
    assert lib.threads == 2


@linux_only
def test_a_timeout_from_the_environment_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = _FakeOpenBlas(timeout=28)  # OPENBLAS_THREAD_TIMEOUT=28 when the library loaded
    assert _shorten(lib) == "configured"
    for name in ("GOTO_THREAD_TIMEOUT", "OPENBLAS_THREAD_TIMEOUT"):
        # Set now, after the library loaded: still the user's setting, not overwritten.
        with monkeypatch.context() as patch:
            patch.setenv(name, "0")
            other = _FakeOpenBlas()
            assert _shorten(other) == "configured"
            assert other.calls == []
            assert os.environ[name] == "0"
    assert lib.calls == []


def test_a_library_without_the_entry_points_is_left_alone() -> None:
    class Mkl:
        _name = "not-openblas"

    assert blas_pool.shorten_idle_spin(Mkl(), lambda: 2, lambda n: None) == "unsupported"


# The real pool, in a fresh process: NumPy's is restarted once per process, and this one's
# was when its first CPU budget was made.
_PROBE = """
import os, sys, threading, time
import numpy as np

rng = np.random.default_rng(0)
a = rng.standard_normal((256, 1024)).astype(np.float32)
b = rng.standard_normal((1024, 1024)).astype(np.float32)

def native_cpu_ms_after_a_product():
    # CPU of the threads Python did not start (OpenBLAS's) in the 50 ms after a product.
    def cpu():
        out = {}
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/schedstat") as stat:
                out[int(tid)] = int(stat.read().split()[0]) / 1e6
        return out
    a @ b
    before = cpu()
    time.sleep(0.05)
    after = cpu()
    python = {thread.native_id for thread in threading.enumerate()}
    return sum(after[t] - before[t] for t in before if t in after and t not in python)

whole = a @ b
spin_before = native_cpu_ms_after_a_product()
from aioautograd.devices.cpu_budget import cpu_budget
budget = cpu_budget()
print(budget._blas.spin, budget._blas.get(), round(spin_before, 1),
      round(native_cpu_ms_after_a_product(), 1), bool(np.array_equal(a @ b, whole)))
"""


def _probe(code: str, **env: str) -> list[str]:
    """Run ``code`` in a fresh interpreter with no thread timeout set but ``env``'s."""
    environment = {k: v for k, v in os.environ.items() if "THREAD_TIMEOUT" not in k}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**environment, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@linux_only
def test_numpy_s_pool_sleeps_soon_after_a_product_once_a_budget_exists() -> None:
    spin, threads, before, after, equal = _probe(_PROBE)
    if spin == "unsupported" or int(threads) < 2 or float(before) < 20.0:
        pytest.skip(f"no spinning OpenBLAS pool here ({spin}, {threads} threads, {before} ms)")
    # OpenBLAS's default spin kept a thread busy for most of the 50 ms; the short one
    # sleeps after ~0.4 ms. The same thread count: bitwise the same product.
    assert spin == "shortened"
    assert float(after) < 10.0
    assert equal == "True"


@linux_only
def test_a_timeout_the_user_set_is_not_changed() -> None:
    spin, *_ = _probe(_PROBE, OPENBLAS_THREAD_TIMEOUT="28")
    assert spin in ("configured", "unsupported")


_CONCURRENT = """
import threading
import numpy as np

rng = np.random.default_rng(1)
a = rng.standard_normal((300, 700)).astype(np.float32)
b = rng.standard_normal((700, 500)).astype(np.float32)
whole = a @ b
results = []
stop = threading.Event()

def products():
    while not stop.is_set():
        # (on one thread while the budget computes or restarts the pool: other roundings)
        results.append(bool(np.allclose(a @ b, whole, rtol=1e-4, atol=1e-3)))

thread = threading.Thread(target=products)
thread.start()
from aioautograd.devices.cpu_budget import cpu_budget
spin = cpu_budget()._blas.spin
stop.set()
thread.join(30)
print(spin, not thread.is_alive(), len(results) > 0 and all(results))
"""


@linux_only
def test_products_on_another_thread_while_the_pool_restarts_complete_and_agree() -> None:
    # Another thread's products run meanwhile (OpenBLAS's threads or one thread): the pool
    # is restarted only once they leave it idle, or left alone; nothing hangs.
    spin, finished, agree = _probe(_CONCURRENT)
    assert spin in ("shortened", "busy", "configured", "unsupported")
    assert finished == "True"
    assert agree == "True"


def test_the_policy_that_manages_blas_again_gets_the_pool_s_outcome() -> None:
    import aioautograd as ag
    from aioautograd.devices.cpu_budget import cpu_budget

    engine = ag.Engine(ag.EnginePolicy(manage_blas_threads=False))
    previous = ag.set_default_engine(engine)
    try:
        assert cpu_budget()._blas is None  # BLAS left alone
    finally:
        ag.set_default_engine(previous if previous is not None else ag.Engine())
        engine.close()
    blas = cpu_budget()._blas
    assert blas is not None
    # Once per process: what the first budget did is what this one reports.
    assert blas.spin in ("shortened", "configured", "busy", "unsupported")
    if blas.spin != "unsupported":
        assert blas.spin in blas_pool._outcomes.values()
