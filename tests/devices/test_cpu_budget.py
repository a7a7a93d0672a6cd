"""The CPU budget: split products equal whole ones, BLAS threads are managed, the count holds."""

from __future__ import annotations

import asyncio
import ctypes
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

import aioautograd as ag
from aioautograd import nn, optim
from aioautograd.devices import cpu_budget as cpu_budget_module
from aioautograd.devices.cpu_budget import (
    HOLD_ITERATIONS,
    LEND_AFTER_CALLBACK,
    LEND_NEVER,
    CpuBudget,
    _BlasThreads,
    _blocks_are_exact,
    _cut_plan,
    _cuts_exactly,
    _sched_getcpu,
    _SplitProduct,
    cpu_budget,
)
from aioautograd.engine import Engine, EnginePolicy
from tests.helpers import train_step

blas = _BlasThreads()
needs_blas_control = pytest.mark.skipif(
    not blas.available, reason="threadpoolctl cannot see NumPy's BLAS here"
)


# Tests of cut products in float32: this BLAS must cut them bitwise (see _blocks_are_exact).
float32_blocks = pytest.mark.skipif(
    not _blocks_are_exact(np.dtype(np.float32)),
    reason="this BLAS rounds float32 products cut in blocks apart from whole ones: never cut",
)


@pytest.fixture
def one_blas_thread() -> Iterator[None]:
    """BLAS on one thread meanwhile, so that the unsplit reference is computed as a chunk is."""
    saved = blas.get()
    blas.set(1)
    yield
    blas.set(saved)


@pytest.mark.usefixtures("one_blas_thread")
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64])
@pytest.mark.parametrize(
    ("m", "k", "n"),
    [
        (256, 784, 512),
        (10, 256, 512),
        (7, 300, 513),
        (1000, 999, 129),
        (2000, 33, 17),
        (8192, 1024, 2),
        (4096, 16, 4096),
        (96, 700, 1000),  # 15 column blocks, the last one 104 wide
        (100, 3000, 129),  # 2 column blocks, the last one 65 wide (not 64 and 1)
        (256, 784, 193),  # float64: column 192 rounded apart from the whole product's...
        (1000, 300, 257),  # ...as column 256 in row blocks: not cut (N % 8 != 0)
    ],
)
def test_split_products_are_bitwise_equal_to_whole_ones(
    m: int, k: int, n: int, dtype: type
) -> None:
    budget = CpuBudget(cores=3, min_split_flops=0.0, manage_blas=False)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    operands = [
        (a, b),
        (np.asfortranarray(a), b),  # transposed layouts, as backward formulas pass them
        (a, np.asfortranarray(b)),
        (np.stack([a, a[::-1]]), b),  # a batch of matrices times one matrix
    ]
    # One BLAS thread, as the engine's budget keeps it while aioautograd computes: the test's
    # own budget does not manage BLAS, and the default engine's restores the process's count
    # when its last thread stops computing, which an earlier test's workers may do meanwhile
    # (two threads round differently from one: benchmarks/blas_exactness.py).
    with threadpool_limits(1, "blas"):
        for left, right in operands:
            assert np.array_equal(budget.matmul(left, right), np.matmul(left, right))
    large = 2 * m * k * n >= 4 * (1 << 21) and max(m, n) >= 128
    assert (budget.split_products > 0) == (large and _cuts_exactly(a, b))
    if dtype is np.float64 and n % 8:
        assert not _cuts_exactly(a, b)  # OpenBLAS's dgemm: see _cuts_exactly


def test_a_blas_whose_column_blocks_round_differently_cuts_rows_at_its_multiple() -> None:
    # OpenBLAS's Haswell kernels (AMD CPUs, Intel without AVX-512) round a float32 product
    # cut at 64 rows or at any column differently from the whole one, but not one cut at a
    # multiple of 12 rows: there products are cut along their rows at multiples of
    # ROW_ALIGN only, bitwise the whole product, and a worker's pair still runs side by side.
    code = """
import numpy as np
from threadpoolctl import threadpool_info
from aioautograd.devices.cpu_budget import CpuBudget, _blocks_are_exact, _cut_rule, _SplitProduct
print([i.get("architecture") for i in threadpool_info() if i["user_api"] == "blas"])
budget = CpuBudget(cores=2, min_split_flops=0.0, manage_blas=False)
rng = np.random.default_rng(0)
a = rng.standard_normal((256, 784)).astype(np.float32)
b = rng.standard_normal((784, 512)).astype(np.float32)
whole = np.matmul(a, b)
out = budget.matmul(a, b)
assert budget.enter()
first, second = budget.matmul_pair(a, b, a.T, out)
budget.leave()
job = _SplitProduct(a, b, 4)
print(
    _blocks_are_exact(np.dtype(np.float32)),
    _cut_rule(np.dtype(np.float32)),
    job._bounds,
    budget.split_products,
    budget.paired_products,
    bool(np.array_equal(out, whole)),
    bool(np.array_equal(first, whole) and np.array_equal(second, np.matmul(a.T, whole))),
)
"""
    env = {**os.environ, "OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    architecture, result = done.stdout.strip().splitlines()
    if "Haswell" not in architecture:
        pytest.skip(f"this BLAS cannot run OpenBLAS's Haswell kernels here ({architecture})")
    assert result == "False (12, True) [0, 72, 132, 192, 256] 1 1 True True"


@pytest.mark.parametrize(
    ("rule", "by_rows", "size", "align"),
    [((64, False), False, 512, 64), ((12, True), True, 256, 12), (None, False, 0, 64)],
)
def test_a_product_is_cut_where_the_blas_s_rule_says(
    monkeypatch: pytest.MonkeyPatch,
    rule: tuple[int, bool] | None,
    by_rows: bool,
    size: int,
    align: int,
) -> None:
    # Both dimensions at 64 (SkylakeX): the longer one, here the columns; rows only at 12
    # (Haswell's float32): the rows however few; never: one whole chunk.
    monkeypatch.setitem(cpu_budget_module._EXACT_BLOCKS, np.dtype(np.float32), rule)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((256, 784)).astype(np.float32)
    b = rng.standard_normal((784, 512)).astype(np.float32)
    assert _cut_plan(a, b) == (by_rows, size, align)
    bounds = _SplitProduct(a, b, 4)._bounds
    if rule is None:
        assert len(bounds) == 2  # one chunk: the whole product
    else:
        assert len(bounds) == 5
        assert bounds[-1] == size
        assert all(bound % align == 0 for bound in bounds[:-1])
        # The larger chunks first (the calling thread claims the first; the last one
        # claimed decides when the threads finish): 21 blocks of 12 rows and 4 rows more,
        # 6/5/5/5 blocks; 8 blocks of 64 columns, 2 each.
        assert bounds == ([0, 72, 132, 192, 256] if by_rows else [0, 128, 256, 384, 512])


@pytest.mark.parametrize(
    ("rule", "weight_rows", "per_thread"),
    [((12, True), 1024, 1), ((12, True), 256, 2), ((64, False), 1024, 2)],
)
def test_a_split_product_repacks_a_large_shared_operand_once_per_thread(
    monkeypatch: pytest.MonkeyPatch, rule: tuple[int, bool], weight_rows: int, per_thread: int
) -> None:
    # Each chunk is a BLAS call that packs the operand all chunks share again: cut along
    # its rows, a product shares its right operand, here a 4 MB weight (one chunk per
    # thread) or a 1 MB one (two); cut along its columns (SkylakeX), its left one (two).
    native = cpu_budget_module._cut_rule(np.dtype(np.float32))
    monkeypatch.setitem(cpu_budget_module._EXACT_BLOCKS, np.dtype(np.float32), rule)
    chunks: list[int] = []

    class Recorded(_SplitProduct):
        def __init__(self, a: np.ndarray, b: np.ndarray, count: int, **kwargs: object) -> None:
            super().__init__(a, b, count)
            chunks.append(len(self._bounds) - 1)

    monkeypatch.setattr(cpu_budget_module, "_SplitProduct", Recorded)
    budget = CpuBudget(cores=2, min_split_flops=0.0, manage_blas=False)
    rng = np.random.default_rng(4)
    a = rng.standard_normal((256, weight_rows)).astype(np.float32)
    b = rng.standard_normal((weight_rows, 1024)).astype(np.float32)
    with threadpool_limits(1, "blas"):  # (as the engine's budget keeps BLAS)
        out = budget.matmul(a, b)
        whole = np.matmul(a, b)
    assert chunks == [2 * per_thread]
    assert budget.split_products == 1
    if rule == native:
        assert np.array_equal(out, whole)  # this BLAS's own rule: bitwise
    else:
        np.testing.assert_allclose(out, whole, rtol=1e-4, atol=1e-3)


def test_products_that_cannot_split_still_compute() -> None:
    budget = CpuBudget(cores=2, min_split_flops=0.0, manage_blas=False)
    rng = np.random.default_rng(1)
    vector = rng.standard_normal(300)
    batched = rng.standard_normal((3, 300, 200))
    matrix = rng.standard_normal((200, 300))
    assert np.array_equal(budget.matmul(matrix, vector), matrix @ vector)
    assert np.array_equal(budget.matmul(matrix, batched), matrix @ batched)
    ints = np.arange(12).reshape(3, 4)
    assert np.array_equal(budget.matmul(ints, ints.T), ints @ ints.T)
    with pytest.raises(ValueError, match="mismatch"):
        budget.matmul(matrix, matrix)
    assert budget.active == 0


@needs_blas_control
def test_blas_runs_on_one_thread_while_counted_and_as_before_after() -> None:
    saved = blas.get()
    blas.set(2)
    try:
        budget = CpuBudget(cores=2, min_split_flops=1e30)
        seen: list[int] = []

        def worker() -> None:  # not the thread that first touched the BLAS setting
            assert budget.enter()
            seen.append(blas.get())
            assert not budget.enter()  # already counted: a reentrant run counts nothing
            budget.leave()
            seen.append(blas.get())

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        assert seen == [1, 2]
        assert budget.active == 0
    finally:
        blas.set(saved)


def _wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_a_worker_starts_only_when_a_core_is_free() -> None:
    budget = CpuBudget(cores=1, min_split_flops=1e30, manage_blas=False)
    events: list[str] = []
    assert budget.enter()  # this thread takes the only core
    thread = _start_worker(budget, events)
    time.sleep(0.05)
    assert events == []  # waiting for the core
    budget.leave()
    thread.join(5)
    assert events == ["entered"]
    assert budget.active == 0
    assert budget.peak == 1


def test_a_worker_yields_its_core_while_a_caller_overdraws_the_budget() -> None:
    budget = CpuBudget(cores=1, min_split_flops=1e30, manage_blas=False)
    events: list[str] = []
    entered = threading.Event()

    def worker() -> None:
        budget.enter()
        entered.set()
        _wait_until(lambda: budget.over_budget())
        budget.wait_for_core()
        events.append("resumed")
        budget.leave()

    thread = threading.Thread(target=worker)
    thread.start()
    entered.wait(5)
    with budget._lock:  # a caller's product counts without waiting (an event loop can't)
        budget._count(1)
    _wait_until(lambda: budget.active == 1)  # the worker gave its core back
    assert events == []
    with budget._lock:
        budget._count(-1)
    thread.join(5)
    assert events == ["resumed"]
    assert budget.active == 0


def _cpu_ticks_by_thread() -> dict[int, int]:
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks[int(tid)] = int(fields[11]) + int(fields[12])  # utime + stime
    return ticks


async def train_four_models_offloaded() -> None:
    models = []
    for seed in range(4):
        ag.manual_seed(seed)
        model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
        opt = optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        models.append((model, opt, ag.randn(256, 256), ag.randint(0, 10, (256,))))

    async def train(model: nn.Module, opt: optim.Optimizer, x: ag.Tensor, y: ag.Tensor) -> None:
        for _ in range(8):
            await ag.offload(train_step, model, opt, x, y)

    await asyncio.gather(*(train(*m) for m in models))


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
async def test_concurrent_offloaded_training_stays_within_the_cores() -> None:
    """Four models trained at once: the threads counted stay within the cores, and threads
    outside the budget (BLAS's own pool, which spins after each multi-threaded call) take
    no CPU time."""
    budget = cpu_budget()
    # Earlier tests ran products on BLAS's own threads, which spin ~0.1 s after each: let
    # them go to sleep, so that what is measured is what this training does.
    await asyncio.sleep(0.3)
    budget.peak = budget.active
    before = _cpu_ticks_by_thread()
    await train_four_models_offloaded()
    after = _cpu_ticks_by_thread()
    ours = {thread.native_id for thread in threading.enumerate()}
    foreign = {tid: after[tid] - before.get(tid, 0) for tid in after if tid not in ours}
    assert budget.peak <= budget.cores
    assert sum(after[tid] - before.get(tid, 0) for tid in after) > 0
    assert all(ticks <= 2 for ticks in foreign.values()), foreign  # 2 ticks: 20 ms


def test_blas_intra_op_runs_a_large_product_on_blas_threads() -> None:
    budget = CpuBudget(cores=2, min_split_flops=0.0)
    budget.intra_op = "blas"
    seen: list[int] = []
    rng = np.random.default_rng(2)
    a = rng.standard_normal((512, 512))
    real_matmul = np.matmul

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(blas.get())
        return real_matmul(*args, **kwargs)

    import aioautograd.devices.cpu_budget as module

    saved = module.np.matmul
    module.np.matmul = spy  # type: ignore[assignment]
    try:
        out = budget.matmul(a, a)
    finally:
        module.np.matmul = saved  # type: ignore[assignment]
    np.testing.assert_allclose(out, a @ a, rtol=1e-12)
    if blas.available:
        assert seen == [2]  # BLAS's own two threads for this product
        assert budget.split_products == 0
    assert budget.active == 0


def test_a_counted_thread_computes_a_large_product_in_slices_with_yield_points() -> None:
    budget = CpuBudget(cores=1, min_split_flops=0.0, manage_blas=False)  # no core to split on
    budget.slice_flops = 2e6
    yields: list[int] = []
    budget.yield_point = lambda: yields.append(1)  # type: ignore[method-assign]
    rng = np.random.default_rng(3)
    a = rng.standard_normal((512, 256))
    b = rng.standard_normal((256, 384))
    assert budget.enter()
    try:
        out = budget.matmul(a, b)
    finally:
        budget.leave()
    assert np.array_equal(out, np.matmul(a, b))  # slices align as splits do: same bits
    assert budget.sliced_products == 1
    assert budget.split_products == 0
    assert len(yields) >= 2  # before the product, and between slices


def _start_worker(budget: CpuBudget, events: list[str]) -> threading.Thread:
    """A thread that waits for a core (as an engine worker does), then records it."""

    def worker() -> None:
        budget.enter()
        events.append("entered")
        budget.leave()

    thread = threading.Thread(target=worker)
    thread.start()
    return thread


async def _loop_iterations(count: int) -> None:
    """Let the loop run ``count`` iterations (each ``sleep(0)`` resumes one iteration later)."""
    for _ in range(count):
        await asyncio.sleep(0)


async def _hold_released() -> None:
    """Let the loop run past an event loop's hold: ``HOLD_ITERATIONS`` iterations after the
    callback that computed, and the one that runs the release."""
    await _loop_iterations(HOLD_ITERATIONS + 1)


async def _enters_once_the_hold_ends(thread: threading.Thread, events: list[str]) -> None:
    """The loop lets the hold end; the worker waiting for a core then enters."""
    await _hold_released()
    thread.join(5)
    assert events == ["entered"]


@pytest.mark.timeout(30)
async def test_an_event_loop_holds_the_cores_until_its_callback_returns() -> None:
    budget = CpuBudget(cores=2, min_split_flops=0.0, manage_blas=False)
    budget.loop_hold_s = 10.0  # only the end of the callback releases the hold here
    rng = np.random.default_rng(4)
    a = rng.standard_normal((256, 512))
    events: list[str] = []
    out = budget.matmul(a, a.T)  # a forward pass's product, on the loop's thread
    assert np.array_equal(out, np.matmul(a, a.T))
    assert budget.active == 2  # held between the forward pass's products
    thread = _start_worker(budget, events)
    thread.join(0.05)  # blocks the loop: still in this callback, the worker waits
    assert events == []
    assert np.array_equal(budget.matmul(a, a.T), out)  # the same hold goes on
    assert budget.active == 2
    await asyncio.sleep(0)  # the callback returns to the loop: the next iteration's I/O...
    assert budget.active == 2  # ...and the tasks it wakes still go first
    await _enters_once_the_hold_ends(thread, events)
    assert budget.active == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("lend", "held"), [(LEND_NEVER, 2), (LEND_AFTER_CALLBACK, 1)])
async def test_the_hold_covers_a_request_that_arrived_while_the_loop_computed(
    lend: int, held: int
) -> None:
    # A server's request read while a forward pass ran on the loop: its reader callback runs
    # in the next iteration and the handler it wakes in the one after; the workers (the
    # backward pass just started) stay off the loop's core until then (off every core unless
    # the hold lends the others), or the loop's thread waits for a core to answer.
    budget = CpuBudget(cores=2, min_split_flops=0.0, manage_blas=False)
    budget.loop_hold_s = 10.0
    budget.lend_cores = lend
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=ours)
    answered: list[tuple[bytes, int]] = []

    async def handler() -> None:
        request = await reader.readexactly(7)
        answered.append((request, budget.active, len(budget._holds)))

    task = asyncio.ensure_future(handler())
    try:
        await asyncio.sleep(0)  # the handler waits for its request
        a = np.random.default_rng(9).standard_normal((256, 512))
        budget.matmul(a, a.T)  # the forward pass's product: the loop holds the cores
        theirs.sendall(b"GET /ok")  # the request arrives while the loop computes
        await asyncio.wait_for(task, 5)
        assert answered == [(b"GET /ok", held, 1)]  # answered under the hold
        await _hold_released()
        assert budget.active == 0
    finally:
        task.cancel()
        writer.close()
        theirs.close()


@pytest.mark.timeout(30)
async def test_the_policy_sets_how_many_iterations_the_hold_lasts() -> None:
    engine = Engine(EnginePolicy(loop_hold_iterations=0, loop_hold_s=10.0))
    previous = ag.set_default_engine(engine)
    try:
        budget = cpu_budget()
        assert budget.hold_iterations == 0
        a = np.random.default_rng(10).standard_normal((1024, 1024))
        budget.matmul(a, a.T)  # large enough to take the hold under the default split size
        assert budget.active == budget.cores
        await asyncio.sleep(0)  # 0: the hold ends as the callback returns
        assert budget.active == 0
    finally:
        assert previous is not None
        ag.set_default_engine(previous)
        engine.close()
    assert cpu_budget().hold_iterations == HOLD_ITERATIONS
    assert cpu_budget().loop_hold_s == EnginePolicy().loop_hold_s


@pytest.mark.timeout(30)
async def test_a_loop_that_blocks_after_its_products_loses_the_hold() -> None:
    budget = CpuBudget(cores=2, min_split_flops=0.0, manage_blas=False)
    budget.loop_hold_s = 0.005
    rng = np.random.default_rng(5)
    a = rng.standard_normal((256, 512))
    events: list[str] = []
    budget.matmul(a, a.T)
    thread = _start_worker(budget, events)
    thread.join(5)  # the loop's thread blocks here, without any product: the hold lapses
    assert events == ["entered"]
    assert budget.active == 0
    await _hold_released()  # the release scheduled on the loop finds nothing to release
    assert budget.active == 0


@pytest.mark.timeout(30)
def test_products_off_a_loop_take_no_hold() -> None:
    budget = CpuBudget(cores=2, min_split_flops=0.0, manage_blas=False)
    budget.loop_hold_s = 10.0
    a = np.random.default_rng(6).standard_normal((256, 512))
    budget.matmul(a, a.T)
    assert budget.active == 0


@pytest.mark.timeout(30)
async def test_each_budget_counts_its_own_hold() -> None:
    a = np.random.default_rng(8).standard_normal((256, 512))
    first = CpuBudget(cores=2, min_split_flops=0.0, manage_blas=False)
    second = CpuBudget(cores=3, min_split_flops=0.0, manage_blas=False)
    for budget in (first, second):
        budget.loop_hold_s = 10.0
        budget.matmul(a, a.T)
    assert (first.active, second.active) == (2, 3)
    await _hold_released()
    assert (first.active, second.active) == (0, 0)


def _pair_operands(dtype: type) -> list[tuple[np.ndarray, ...]]:
    """A linear layer's two gradient products, ``g @ w.T`` and ``x.T @ g``, in the layouts the
    backward formulas pass (transposed views), plus a batched left operand."""
    rng = np.random.default_rng(4)
    g = rng.standard_normal((256, 512)).astype(dtype)
    w = rng.standard_normal((384, 512)).astype(dtype)
    x = rng.standard_normal((256, 384)).astype(dtype)
    batched = rng.standard_normal((2, 128, 512)).astype(dtype)
    return [(g, w.T, x.T, g), (x.T, g, g, w.T), (batched, w.T, g.T, x)]


@pytest.mark.usefixtures("one_blas_thread")
@pytest.mark.parametrize("dtype", [pytest.param(np.float32, marks=float32_blocks), np.float64])
def test_paired_products_are_bitwise_the_whole_ones(dtype: type) -> None:
    budget = CpuBudget(cores=2, min_split_flops=0.0, manage_blas=False)
    assert budget.enter()  # a worker's thread: the only kind that pairs
    try:
        for a1, b1, a2, b2 in _pair_operands(dtype):
            first, second = budget.matmul_pair(a1, b1, a2, b2)
            assert np.array_equal(first, np.matmul(a1, b1))
            assert np.array_equal(second, np.matmul(a2, b2))
            assert first.dtype == dtype
            assert second.dtype == dtype
        assert budget.paired_products == 3
        assert budget.split_products == 0  # counted as pairs, not as two split products
        assert budget.active == 1  # the helper's core is given back
    finally:
        budget.leave()
    assert budget.peak <= budget.cores
    assert budget.active == 0


@float32_blocks
@pytest.mark.usefixtures("one_blas_thread")
def test_products_are_not_paired_without_a_free_core_or_off_a_worker() -> None:
    a1, b1, a2, b2 = _pair_operands(np.float32)[0]
    expected = (np.matmul(a1, b1), np.matmul(a2, b2))
    one_core = CpuBudget(cores=1, min_split_flops=0.0, manage_blas=False)
    assert one_core.enter()
    try:
        results = one_core.matmul_pair(a1, b1, a2, b2)  # no core free: one after the other
    finally:
        one_core.leave()
    two_cores = CpuBudget(cores=2, min_split_flops=0.0, manage_blas=False)
    uncounted = two_cores.matmul_pair(a1, b1, a2, b2)  # not a worker: matmul's own splits
    for pair in (results, uncounted):
        assert all(np.array_equal(r, e) for r, e in zip(pair, expected, strict=True))
    assert one_core.paired_products == 0
    assert two_cores.paired_products == 0
    assert two_cores.split_products == 2
    assert one_core.active == 0
    assert two_cores.active == 0


def test_unpairable_products_compute_or_raise_as_matmul_does() -> None:
    budget = CpuBudget(cores=2, min_split_flops=0.0, manage_blas=False)
    ints = np.arange(12).reshape(3, 4)
    matrix = np.ones((200, 300))
    assert budget.enter()
    try:
        first, second = budget.matmul_pair(ints, ints.T, matrix, matrix.T)
        assert np.array_equal(first, ints @ ints.T)
        np.testing.assert_allclose(second, matrix @ matrix.T)
        with pytest.raises(ValueError, match="mismatch"):
            budget.matmul_pair(matrix, matrix.T, matrix, matrix)
    finally:
        budget.leave()
    assert budget.paired_products == 0
    assert budget.active == 0


@float32_blocks
@pytest.mark.usefixtures("one_blas_thread")
def test_a_worker_pauses_once_its_helper_has_the_chunks() -> None:
    """A counted thread's pause before a split or paired product comes after the helper got
    its chunks (the helper computes during the pause); before an unsplit product, first."""
    budget = CpuBudget(cores=2, min_split_flops=0.0, manage_blas=False)
    counted_at_pause: list[int] = []
    budget.yield_point = lambda: counted_at_pause.append(budget.active)  # type: ignore[method-assign]
    a1, b1, a2, b2 = _pair_operands(np.float32)[0]
    assert budget.enter()
    try:
        budget.matmul(a1, b1)
        budget.matmul_pair(a1, b1, a2, b2)
    finally:
        budget.leave()
    assert budget.split_products == 1
    assert budget.paired_products == 1
    # Once before each product (the pair's also between the chunks this thread computes),
    # always with the helper counted: it had its chunks already.
    assert len(counted_at_pause) >= 2
    assert set(counted_at_pause) == {2}
    alone = CpuBudget(cores=1, min_split_flops=0.0, manage_blas=False)
    alone_at_pause: list[int] = []
    alone.yield_point = lambda: alone_at_pause.append(alone.active)  # type: ignore[method-assign]
    assert alone.enter()
    try:
        assert np.array_equal(alone.matmul(a1, b1), np.matmul(a1, b1))
    finally:
        alone.leave()
    assert alone_at_pause == [1]  # no helper: the pause comes first, as before


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("lend", "held"), [(LEND_NEVER, 2), (LEND_AFTER_CALLBACK, 1)])
async def test_a_turn_holds_the_cores_only_while_workers_compute(lend: int, held: int) -> None:
    budget = CpuBudget(cores=2, min_split_flops=0.0, manage_blas=False)
    budget.loop_hold_s = 10.0
    budget.loop_shares = False  # the hold, not the default sharing: what this test is about
    budget.lend_cores = lend
    loop = asyncio.get_running_loop()
    rng = np.random.default_rng(0)
    # float64, 256 columns: OpenBLAS cuts it exactly on every kernel we know of (float32
    # not on its Haswell ones; a loop whose products are never cut takes no turn hold).
    a = rng.standard_normal((256, 128))
    b = rng.standard_normal((128, 256))
    if not _cuts_exactly(a, b):
        pytest.skip("this BLAS does not cut float64 products exactly: the loop never holds")
    assert np.array_equal(budget.matmul(a, b), np.matmul(a, b))  # a forward's product: held
    await _hold_released()  # its callback returned: the hold is gone
    assert budget.active == 0
    budget.hold_for_turn(loop)  # nothing computes: nobody to ask, nothing taken
    assert budget.active == 0
    budget.enter()  # a worker computes (this thread stands in for it)
    try:
        budget.hold_for_turn(loop)
        # Every core, or the loop's own one while it runs Python (lending the rest): the
        # worker and a second one are over the budget either way.
        assert budget.active == 1 + held
        events: list[str] = []
        thread = _start_worker(budget, events)
        thread.join(0.05)  # still in this callback: a second worker waits for a core
        assert events == []
        await _enters_once_the_hold_ends(thread, events)  # the callback returns
        assert budget.active == 1  # the worker's own count, no hold left
    finally:
        budget.leave()
    assert budget.active == 0


@float32_blocks
@pytest.mark.timeout(30)
async def test_a_turn_holds_the_cores_from_a_worker_woken_but_not_yet_counted() -> None:
    # A worker parked by the loop's last hold is woken as that hold ends, but counts itself
    # again only once it runs: a turn starting in between must still hold the cores, or the
    # worker computes through it.
    budget = CpuBudget(cores=2, min_split_flops=0.0, manage_blas=False)
    budget.loop_hold_s = 10.0
    budget.lend_cores = LEND_NEVER  # (lent, the turn's hold would let the worker in)
    loop = asyncio.get_running_loop()
    rng = np.random.default_rng(2)
    a = rng.standard_normal((256, 128)).astype(np.float32)
    budget.matmul(a, a.T)  # a forward's product: the loop holds both cores
    events: list[str] = []
    thread = _start_worker(budget, events)
    deadline = time.monotonic() + 5
    while budget._waiting == 0 and time.monotonic() < deadline:
        thread.join(0.001)  # the worker parks, waiting for a core
    assert budget._waiting == 1
    previous = sys.getswitchinterval()
    sys.setswitchinterval(5.0)  # this thread keeps the GIL: the woken worker cannot count
    try:
        # The hold ends and wakes the worker (as its release does, but without a loop
        # iteration: polling for I/O would let the worker in)...
        with budget._lock:
            budget._drop_hold(budget._holds[0])
        assert budget.active == 0  # ...which has not counted itself yet
        assert events == []
        budget.hold_for_turn(loop)  # the turn starts now
    finally:
        sys.setswitchinterval(previous)
    assert budget.active == 2  # held: the worker waits through the turn
    thread.join(0.05)
    assert events == []
    await _enters_once_the_hold_ends(thread, events)
    assert budget.active == 0


@pytest.mark.timeout(30)
async def test_a_loop_whose_products_never_took_the_cores_does_not_hold_them_for_its_turn() -> None:
    # A Python-bound model (products below the split size) runs its turn beside the workers:
    # holding the cores would only park them while the loop runs Python.
    budget = CpuBudget(cores=2, min_split_flops=float("inf"), manage_blas=False)
    budget.loop_hold_s = 10.0
    loop = asyncio.get_running_loop()
    rng = np.random.default_rng(1)
    a = rng.standard_normal((64, 64)).astype(np.float32)
    b = rng.standard_normal((64, 64)).astype(np.float32)
    result: list[np.ndarray] = []
    budget.enter()  # a worker computes
    try:
        result.append(budget.matmul(a, b))  # too small to split: counted, no hold taken
        budget.hold_for_turn(loop)
        assert budget.active == 1  # the worker's own count only
    finally:
        budget.leave()
    assert np.array_equal(result[0], np.matmul(a, b))


needs_two_cpus_and_affinity = pytest.mark.skipif(
    _sched_getcpu is None or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux thread affinity and at least two usable CPUs",
)


def _on_a_thread_pinned_to(
    budget: CpuBudget, cpu: int, compute: Callable[[], bool]
) -> tuple[bool, set[int]]:
    """``compute()`` (products on ``budget``; whether they equal ``numpy.matmul``'s) on a
    fresh thread pinned to ``cpu``: its answer, and the CPUs the helper may run on after."""
    outcome: list[tuple[bool, set[int]]] = []

    def caller() -> None:
        os.sched_setaffinity(0, {cpu})
        equal = compute()
        helper_tid = budget._helpers[0].thread.native_id
        assert helper_tid is not None
        outcome.append((equal, os.sched_getaffinity(helper_tid)))

    thread = threading.Thread(target=caller)
    thread.start()
    thread.join(20)
    assert outcome, "the caller thread did not finish"
    return outcome[0]


def _split_from_a_thread_on(
    budget: CpuBudget, cpu: int, a: np.ndarray, b: np.ndarray
) -> tuple[bool, set[int]]:
    """``budget.matmul(a, b)`` from a fresh thread pinned to ``cpu``: whether the result is
    ``numpy.matmul``'s, and the CPUs the helper may run on afterwards."""
    return _on_a_thread_pinned_to(
        budget, cpu, lambda: np.array_equal(budget.matmul(a, b), np.matmul(a, b))
    )


@pytest.mark.timeout(60)
@float32_blocks
@needs_two_cpus_and_affinity
@pytest.mark.usefixtures("one_blas_thread")
def test_a_helper_is_kept_off_the_cpu_of_the_thread_that_splits_a_product() -> None:
    """The helper woken for a split product may run anywhere but on its caller's CPU, where
    it would wait for the caller's own chunks; it follows the caller from CPU to CPU."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((256, 784)).astype(np.float32)
    b = rng.standard_normal((784, 512)).astype(np.float32)
    budget = CpuBudget(cores=2, min_split_flops=0.0, manage_blas=False)
    process_cpus = os.sched_getaffinity(os.getpid())
    first, second = sorted(process_cpus)[:2]
    for cpu in (first, second, first):
        equal, helper_cpus = _split_from_a_thread_on(budget, cpu, a, b)
        assert equal
        assert cpu not in helper_cpus
        assert helper_cpus == process_cpus - {cpu}
    assert budget.split_products == 3


@pytest.mark.timeout(60)
@float32_blocks
@needs_two_cpus_and_affinity
@pytest.mark.usefixtures("one_blas_thread")
def test_the_policy_can_leave_the_helpers_placement_to_the_kernel() -> None:
    rng = np.random.default_rng(4)
    a = rng.standard_normal((256, 784)).astype(np.float32)
    b = rng.standard_normal((784, 512)).astype(np.float32)
    budget = CpuBudget(cores=2, min_split_flops=0.0, manage_blas=False)
    budget.place_helpers = False
    equal, helper_cpus = _split_from_a_thread_on(budget, sorted(os.sched_getaffinity(0))[0], a, b)
    assert equal
    assert budget.split_products == 1
    # Created by the pinned caller, the helper inherited its CPU and kept it: nothing moved it.
    assert len(helper_cpus) == 1


@pytest.mark.timeout(60)
@float32_blocks
@needs_two_cpus_and_affinity
@pytest.mark.usefixtures("one_blas_thread")
def test_a_paired_product_places_its_helper_too() -> None:
    a1, b1, a2, b2 = _pair_operands(np.float32)[0]
    budget = CpuBudget(cores=2, min_split_flops=0.0, manage_blas=False)
    cpu = sorted(os.sched_getaffinity(0))[1]

    def pair_on_a_worker() -> bool:
        assert budget.enter()
        try:
            first, second = budget.matmul_pair(a1, b1, a2, b2)
        finally:
            budget.leave()
        return np.array_equal(first, np.matmul(a1, b1)) and np.array_equal(
            second, np.matmul(a2, b2)
        )

    equal, helper_cpus = _on_a_thread_pinned_to(budget, cpu, pair_on_a_worker)
    assert equal
    assert budget.paired_products == 1
    assert cpu not in helper_cpus


@pytest.mark.timeout(30)
@needs_two_cpus_and_affinity
def test_a_helper_is_placed_through_a_call_that_releases_the_gil(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``os.sched_setaffinity`` holds the GIL for the whole system call (up to 6 ms measured
    while the kernel migrated the helper); ctypes calls the C function without it."""
    from aioautograd.devices import cpu_budget as cpu_budget_module

    function = cpu_budget_module._sched_setaffinity
    assert isinstance(function, ctypes._CFuncPtr)
    assert not function._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # a CDLL call: GIL released
    calls: list[tuple[int, set[int]]] = []
    original = cpu_budget_module._set_affinity

    def recording(tid: int, cpus: set[int]) -> None:
        calls.append((tid, set(cpus)))
        original(tid, cpus)

    monkeypatch.setattr(cpu_budget_module, "_set_affinity", recording)
    monkeypatch.setattr(os, "sched_setaffinity", None)  # the old path would fail
    budget = CpuBudget(cores=2, min_split_flops=0.0, manage_blas=False)
    helper = budget._take_helpers(1)[0]
    process_cpus = os.sched_getaffinity(os.getpid())
    for cpu in sorted(process_cpus)[:2]:
        helper.avoid_cpu(cpu)
        assert helper.avoided_cpu == cpu
        assert os.sched_getaffinity(helper.thread.native_id) == process_cpus - {cpu}
    assert calls == [
        (helper.thread.native_id, process_cpus - {cpu}) for cpu in sorted(process_cpus)[:2]
    ]


@needs_two_cpus_and_affinity
def test_an_affinity_the_kernel_refuses_raises_and_leaves_the_thread_as_it_was() -> None:
    from aioautograd.devices.cpu_budget import _set_affinity

    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, daemon=True)
    thread.start()
    tid = thread.native_id
    assert tid is not None
    try:
        before = os.sched_getaffinity(tid)
        with pytest.raises(OSError, match="Invalid argument"):
            _set_affinity(tid, {4096})  # no such CPU (a mask wider than glibc's cpu_set_t)
        assert os.sched_getaffinity(tid) == before
        first = sorted(before)[0]
        _set_affinity(tid, {first})
        assert os.sched_getaffinity(tid) == {first}
    finally:
        stop.set()
        thread.join(10)


def test_the_policy_reaches_the_budget_s_helper_placement() -> None:
    engine = Engine(EnginePolicy(place_helpers=False))
    previous = ag.set_default_engine(engine)
    try:
        assert cpu_budget().place_helpers is False
    finally:
        assert previous is not None
        ag.set_default_engine(previous)
        engine.close()
    assert cpu_budget().place_helpers is True


def test_the_cpu_backend_computes_small_products_itself_and_larger_ones_on_the_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    budget = cpu_budget()
    calls: list[str] = []

    def counted(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        calls.append("matmul")
        return np.matmul(a, b)

    def counted_pair(
        a1: np.ndarray, b1: np.ndarray, a2: np.ndarray, b2: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        calls.append("pair")
        return np.matmul(a1, b1), np.matmul(a2, b2)

    monkeypatch.setattr(budget, "matmul", counted)
    monkeypatch.setattr(budget, "matmul_pair", counted_pair)
    backend = ag.device("cpu").backend
    rng = np.random.default_rng(0)
    small_a, small_b = rng.standard_normal((8, 64)), rng.standard_normal((64, 64))
    large_a = rng.standard_normal((256, 64))  # 2 * 256 * 64 * 64 flops: counted
    assert 2.0 * small_a.size * 64 < budget.min_counted_flops <= 2.0 * large_a.size * 64
    np.testing.assert_array_equal(backend.matmul(small_a, small_b), small_a @ small_b)
    first, second = backend.matmul_pair(small_a, small_b, small_b[:8], small_b)
    np.testing.assert_array_equal(first, small_a @ small_b)
    np.testing.assert_array_equal(second, small_b[:8] @ small_b)
    assert calls == []
    np.testing.assert_array_equal(backend.matmul(large_a, small_b), large_a @ small_b)
    np.testing.assert_array_equal(backend.matmul(small_b[0], small_b), small_b[0] @ small_b)
    backend.matmul_pair(small_a, small_b, large_a, small_b)  # one product too large: paired
    assert calls == ["matmul", "matmul", "pair"]
    calls.clear()
    monkeypatch.setattr(budget, "min_counted_flops", 0.0)  # every product counted
    backend.matmul(small_a, small_b)
    backend.matmul_pair(small_a, small_b, small_a, small_b)
    assert calls == ["matmul", "pair"]
