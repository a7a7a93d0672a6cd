"""The CPU budget: every thread that computes on the CPU counts against the machine's cores.

Why the library, not the user, decides how many threads compute. Measured on 2 cores in the
default environment (no BLAS variables set), four models trained at once with
``asyncio.gather`` ran 4x slower than one after another:

- OpenBLAS's thread count is process-wide (``openblas_set_num_threads_local`` of the pthreads
  build that NumPy ships sets the global count too), so the engine's workers, the caller's
  thread and every BLAS call each asked for all the cores at once;
- after a multi-threaded call OpenBLAS's helper threads spin for about 0.1 s of CPU before
  they sleep (0.105 s of CPU in a 0.2 s idle window after one product), taking a core from
  whatever thread computes next.

So while aioautograd computes, NumPy's BLAS runs on one thread, and large matrix products are
split over the budget's own helper threads instead (PyTorch's intra-op parallelism), but only
into cores that no other thread is computing on: one model alone gets both cores for its
products, four models at once get one each, and nothing spins. A backward's two independent
products (a linear layer's input and weight gradients) run side by side instead, one per
thread (``CpuBudget.matmul_pair``). The BLAS thread count the
process had is restored whenever no aioautograd thread computes, so the user's own NumPy code
between steps runs as it always did; OpenBLAS's pool is restarted once with a short idle spin
(``blas_pool.py``), or those products would leave it spinning on a core the next backward needs.

Who counts: engine workers while they run nodes (``enter``/``leave``, called by the
executor per run of nodes), helper threads while they run a part of a product, and any other
thread (a user's) for the duration of a large product it runs. An event loop's thread whose
large product comes while other threads compute takes one core for it, as they do
(``EnginePolicy.loop_shares_cores``, the default). One whose product comes while nothing else
computes (or any, with ``loop_shares_cores`` off) holds every core until its callback has
returned to the loop and the loop has run the I/O and tasks that became ready meanwhile (see
``CpuBudget.matmul``); while it runs Python in that time instead of a product, it keeps one
core and lends the others to parked workers until its next product (``CpuBudget._lend``).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import math
import os
import queue
import sys
import threading
import time
from asyncio import _get_running_loop
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from aioautograd.devices.blas_pool import openblas_symbol, shorten_idle_spin
from aioautograd.devices.gil_waiters import register_engine_thread
from aioautograd.devices.memory import keep_freed_memory
from aioautograd.devices.thread_slice import drop_inherited_slice


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS tells, else the count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class _ThreadState(threading.local):
    counted: bool = False  # this thread already counts against the budget (a busy worker)
    hold: _LoopHold | None = None  # an event loop's thread: its current hold on the cores
    product_hold_at: float = -math.inf  # an event loop's thread: its last large product...
    product_hold_budget: CpuBudget | None = None  # ...on this budget


class _LoopHold:
    """The cores an event loop's thread holds while its current callback computes (see
    ``CpuBudget.matmul``)."""

    __slots__ = ("budget", "hops", "lent", "units", "until")

    def __init__(self, budget: CpuBudget, units: int) -> None:
        self.budget = budget
        self.units = units  # counted against the budget; 0 once released
        self.lent = False  # the loop runs Python: it counts one core, the rest are lent
        self.until = math.inf  # released at this time (perf_counter) unless renewed
        self.hops = 0  # loop iterations left before the release (``CpuBudget._release_hold``)


_thread = _ThreadState()


class _BlasThreads:
    """NumPy's BLAS thread count, set and read through the library's own C functions (about
    1 µs each). threadpoolctl finds the library; for OpenBLAS's process-wide pool its own
    setter is bypassed, because it lets only the first thread that used it change the count
    (a worker thread's later calls would be ignored). OpenBLAS's pool is restarted with a
    short idle spin, once per process (``blas_pool.shorten_idle_spin``); ``spin`` says how
    that went."""

    def __init__(self) -> None:
        self._get: Callable[[], int] | None = None
        self._set: Callable[[int], Any] | None = None
        self.spin = "unsupported"
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:
            return
        controllers = [c for c in ThreadpoolController().lib_controllers if c.user_api == "blas"]
        numpy_owned = [c for c in controllers if "numpy" in str(c.filepath)]
        chosen = (numpy_owned or controllers or [None])[0]
        if chosen is None:
            return
        self._get = chosen.get_num_threads
        self._set = chosen.set_num_threads
        if chosen.internal_api == "openblas" and chosen.threading_layer == "pthreads":
            setter = openblas_symbol(chosen.dynlib, "openblas_set_num_threads")
            if setter is not None:
                self._set = setter
                self.spin = shorten_idle_spin(chosen.dynlib, self.get, setter)

    @property
    def available(self) -> bool:
        return self._get is not None

    def get(self) -> int:
        return int(self._get()) if self._get is not None else 1

    def set(self, threads: int) -> None:
        if self._set is not None:
            self._set(threads)


class CpuBudget:
    """How many threads compute on the CPU now, and the helpers that split large products.

    One instance per process (:func:`cpu_budget`): cores and BLAS pools are process-wide.

    Args:
        cores: the number of threads that may compute at once.
        min_split_flops: a product smaller than this runs whole on the calling thread (waking
            a helper costs tens of microseconds; see :class:`aioautograd.engine.EnginePolicy`).
        min_counted_flops: a product smaller than this is not counted (BLAS runs it on one
            thread whatever its setting, and counting costs a lock and two BLAS calls).
        manage_blas: keep NumPy's BLAS on one thread while aioautograd computes.
    """

    # Called by counted threads before each large product: the engine installs its worker
    # pause here (``executor.pause_if_due``), so a step offloaded to a worker also lets the
    # event loop's thread in regularly.
    yield_point: Callable[[], None] = staticmethod(lambda: None)
    # Called by a thread that has just blocked this long without the GIL, waiting for its
    # helpers' last chunks: that wait let other threads in as a pause would (the engine
    # installs ``executor.rested``, which then spares the worker its next pause).
    rest_point: Callable[[float], None] = staticmethod(lambda waited: None)

    def __init__(
        self,
        cores: int,
        min_split_flops: float,
        min_counted_flops: float = 0.0,
        manage_blas: bool = True,
    ) -> None:
        self.cores = max(1, cores)
        self.min_split_flops = min_split_flops
        self.min_counted_flops = min_counted_flops
        self.intra_op = "split"  # or "blas": see EnginePolicy.intra_op
        self._lock = threading.Lock()
        self._slot_free = threading.Condition(self._lock)
        self._waiting = 0  # workers waiting for a core (``wait_for_core``)
        self.active = 0
        self.peak = 0  # the most threads ever counted at once (tests check the budget)
        self.split_products = 0  # products run in parts (observability)
        self.split_backoffs = 0  # times splitting paused because helpers were starved
        self.sliced_products = 0  # products run in sequential slices (observability)
        self.paired_products = 0  # pairs of products run side by side (observability)
        self.shared_products = 0  # loop products run on one core (``loop_shares``)
        self.slice_flops = 1.0e8
        self.place_helpers = True  # see EnginePolicy.place_helpers
        self.loop_hold_s = 0.0  # see EnginePolicy.loop_hold_s
        self.hold_iterations = HOLD_ITERATIONS  # see EnginePolicy.loop_hold_iterations
        self.lend_cores = LEND_AFTER_CALLBACK  # see EnginePolicy.loop_lends_cores
        self.lent_slice_flops = 2.5e7  # see EnginePolicy.lent_slice_flops
        self.loop_shares = True  # see EnginePolicy.loop_shares_cores
        self._holds: list[_LoopHold] = []
        self._lent = 0  # holds lending their cores now (``_lend``)
        self._no_split_until = 0.0
        self._starved = 0  # split products in a row whose helpers were late
        self._blas = _BlasThreads() if manage_blas else None
        self._user_blas_threads = self._blas.get() if self._blas is not None else 1
        self._idle_helpers: list[_Helper] = []
        self._helpers: list[_Helper] = []

    # ------------------------------------------------------------------ accounting
    def enter(self) -> bool:
        """Count the calling thread as computing, once a core is free (an engine worker
        about to run nodes: it waits while the budget is spent).

        Returns False, counting nothing, if the thread already counts (a reentrant run);
        call :meth:`leave` only after an ``enter`` that returned True.
        """
        if _thread.counted:
            return False
        with self._lock:
            self._wait_for_room()
            self._count(1)
        _thread.counted = True
        return True

    def leave(self) -> None:
        """Stop counting the calling thread."""
        _thread.counted = False
        with self._lock:
            self._count(-1)

    @contextlib.contextmanager
    def lent(self) -> Iterator[None]:
        """Stop counting the calling thread while it blocks (if it was counted)."""
        if not _thread.counted:
            yield
            return
        self.leave()
        try:
            yield
        finally:
            self.enter()

    def over_budget(self) -> bool:
        """Whether more threads compute than there are cores (an unlocked read: a hint)."""
        return self.active > self.cores

    def wait_for_core(self) -> None:
        """Give up the calling (counted) thread's core until the count is within budget.

        A worker calls this between two nodes when a thread outside the engine (the event
        loop running a forward pass, say) pushed the count over the cores: callers cannot
        wait, workers can.
        """
        if not _thread.counted:
            return
        with self._lock:
            if self._holds:
                self._expire_holds()
            if self.active <= self.cores:
                return
            self._count(-1)
            self._wait_for_room()
            self._count(1)

    def _wait_for_room(self) -> None:
        # Called with the lock held. An event loop's hold that lapses frees room without a
        # notification: waiters then wake on their own to release it.
        if self.active < self.cores:
            return
        self._waiting += 1
        try:
            while True:
                timeout = self._expire_holds() if self._holds else None
                if self.active < self.cores:
                    return
                self._slot_free.wait(timeout)
        finally:
            self._waiting -= 1

    def _take_hold(self, loop: Any) -> _LoopHold:
        """The calling event loop thread's hold on every core, taken if it has none (lock
        held). Released ``hold_iterations`` loop iterations after the callback that computes
        (``_release_hold``; 0: as that callback returns), or ``loop_hold_s`` after the
        thread's last product, whichever comes first."""
        hold = _thread.hold
        if hold is not None and hold.budget is not self:
            hold = None  # another budget's (tests make their own)
        elif hold is not None and hold.units and hold.until <= time.perf_counter():
            self._drop_hold(hold)  # lapsed (its loop may not have run the release)
        if hold is None or hold.units == 0:
            hold = _thread.hold = _LoopHold(self, self.cores)
            self._holds.append(hold)
            self._count(hold.units)
            if self.hold_iterations > 0:
                loop.call_at(loop.time(), self._release_hold, hold, loop)
            else:
                loop.call_soon(self._release_hold, hold, loop)
        elif hold.lent:
            # A product again: the lent cores come back (their workers are over the budget
            # and park at their next node or slice, ``lent_slice_flops`` away).
            hold.lent = False
            self._lent -= 1
            units, hold.units = hold.units, self.cores
            self._count(self.cores - units)
        hold.until = math.inf  # not while it computes
        hold.hops = self.hold_iterations
        return hold

    def hold_for_turn(self, loop: Any) -> None:
        """The calling event loop's thread starts a coroutine's turn (it resumed from an
        awaited CPU backward pass: natural code runs its optimizer step and next forward pass
        now): while engine workers compute, hold every core as the turn's first large
        product would, until the current callback returns (and ``hold_iterations`` more
        loop iterations) or ``loop_hold_s`` passes without a product. Not with
        ``loop_shares`` (the default): then a turn takes no hold.

        Why at the turn's start: a worker gives up its core at its next node or product
        slice (about 1 ms of BLAS). Asked only by the forward pass's first product, the
        workers were still computing while the optimizer step and that product ran, on
        cores and a GIL shared four ways: in ``concurrent`` (natural code) a turn took 5.4
        ms at the median and up to 11-20 ms, against 4.0 and 8 with the request made here.
        """
        if self.loop_hold_s <= 0 or self.loop_shares:
            return
        state = _thread
        if (
            state.product_hold_budget is not self
            or time.perf_counter() - state.product_hold_at > TURN_HOLD_MEMORY_S
        ):
            # This loop's own products are too small to take the cores (a Python-bound
            # model): holding them for its turn would only park the workers while it runs
            # Python (4 x 256-256-256-10 natural code: 0.79x sequential with it, 1.03-1.11x
            # without).
            return
        with self._lock:
            # Nobody to ask: no thread counts and none waits for a core. A worker parked by
            # this loop's last hold and woken as it lapsed waits here until it counts itself
            # again: read without the lock, ``active`` was 0 at that moment and the worker
            # then computed through the whole turn.
            if not self.active and not self._waiting:
                return
            hold = self._take_hold(loop)
            hold.until = time.perf_counter() + self.loop_hold_s
            if self.lend_cores:
                self._lend(hold)  # the turn starts with Python (the optimizer step)

    def _release_hold(self, hold: _LoopHold, loop: Any) -> None:
        """(loop, a timer due at once) Release the hold once the loop has run the callbacks
        that became ready while it computed: the I/O callbacks of the next iteration (a
        request's bytes read while a forward pass ran) and the tasks they wake, one
        iteration later (the request's handler). A timer due now runs after the iteration's
        I/O callbacks and after the callbacks the previous iteration scheduled; released at
        once instead (``call_soon``), the hold ended before that I/O was read, the engine's
        workers took both cores for the backward pass just started, and the loop's thread,
        having just computed the forward pass, waited for a core to answer (see
        benchmarks/README.md, session 24)."""
        if hold.units and hold.hops > 1:
            hold.hops -= 1
            loop.call_at(loop.time(), self._release_hold, hold, loop)
            if self.lend_cores and not hold.lent:
                with self._lock:
                    self._lend(hold)  # the callback that computed has returned
            return
        with self._lock:
            self._drop_hold(hold)

    def _lend(self, hold: _LoopHold) -> None:
        """(lock held) The loop's thread runs Python now, not a product: it keeps its own
        core and lends the others to parked workers until its next product takes them back
        (``_take_hold``). A worker lent a core computes its products in slices of
        ``lent_slice_flops`` (about 0.3 ms), so that it leaves within one slice when the
        loop's next product starts.

        Why: the hold parked every worker for the loop's whole turn (its optimizer step, the
        forward pass's Python, the loop iterations after it): in ``concurrent`` (natural
        code) a core was left free for 84 ms of a 300 ms run, most of it while the loop's
        thread ran Python (benchmarks/README.md, sessions 25 and 26)."""
        if hold.lent or hold.units <= 1:
            return
        hold.lent = True
        self._lent += 1
        units, hold.units = hold.units, 1
        self._count(1 - units)

    def _drop_hold(self, hold: _LoopHold) -> None:
        # Called with the lock held.
        if hold.units:
            if hold.lent:
                hold.lent = False
                self._lent -= 1
            units, hold.units = hold.units, 0
            self._holds.remove(hold)
            self._count(-units)
            if self._waiting:
                self._slot_free.notify_all()

    def _expire_holds(self) -> float | None:
        """Release the holds whose time is up (lock held); return how long until the next
        one may be (``loop_hold_s`` for a hold whose thread is computing)."""
        now = time.perf_counter()
        timeout: float | None = None
        for hold in list(self._holds):
            if hold.until <= now:
                self._drop_hold(hold)
            else:
                left = min(hold.until - now, max(self.loop_hold_s, 1e-4))
                timeout = left if timeout is None else min(timeout, left)
        return timeout

    def _count(self, delta: int) -> None:
        # Called with the lock held. BLAS goes to one thread when the first thread starts
        # computing and back to the user's count when the last one stops.
        active = self.active + delta
        blas = self._blas
        if blas is not None:
            if self.active == 0 and active > 0:
                self._user_blas_threads = blas.get()
                if self._user_blas_threads != 1:
                    blas.set(1)
            elif active == 0 and self._user_blas_threads != 1:
                blas.set(self._user_blas_threads)
        self.active = active
        if active > self.peak:
            self.peak = active
        if delta < 0 and self._waiting:
            self._slot_free.notify(-delta)

    # ------------------------------------------------------------------- products
    def matmul(self, a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> Any:
        """``numpy.matmul(a, b)``, split over idle cores when it is large enough.

        The result is bitwise the same whether the product is split or not (chunks are
        aligned to ``CHUNK_ALIGN``, so every element is computed by the same kernel in the
        same order), which keeps gradients reproducible whatever the load. A product on an
        event loop's thread that comes while other threads compute takes one core, as theirs
        do (``loop_shares``, the default). Otherwise (nothing else computing, or
        ``loop_shares`` off) it is urgent (every coroutine of that loop waits for it): it
        takes every core, and the engine's workers yield theirs at their next node boundary
        or product slice. A large one holds them until the loop's current callback returns
        (a forward pass in a coroutine is several products with short gaps between them:
        without the hold the workers came back for each gap and the next product waited
        for them to leave again) and the loop has run ``hold_iterations`` more iterations
        (the requests that arrived meanwhile: see ``_release_hold``), or ``loop_hold_s``
        after the thread's last product.
        """
        if a.dtype.kind not in "fc" or b.dtype.kind not in "fc" or a.ndim == 0 or b.ndim == 0:
            return np.matmul(a, b)
        flops = 2.0 * a.size * (b.shape[-1] if b.ndim > 1 else 1)
        if flops < self.min_counted_flops:
            return np.matmul(a, b)
        split_size = 0  # the length of the dimension the product is cut along
        align = CHUNK_ALIGN  # ...at multiples of this
        if (
            flops >= self.min_split_flops
            and a.ndim >= 2
            and b.ndim == 2
            and time.perf_counter() >= self._no_split_until
        ):
            _, split_size, align = _cut_plan(a, b)
        splittable = split_size >= 2 * align and flops >= 4 * MIN_CHUNK_MACS
        counted = _thread.counted
        # A counted thread's pause (``yield_point``) waits until the helpers have their
        # chunks when the product is likely to be split: they compute meanwhile instead of
        # idling too (3 pauses of ~0.1 ms per backward of the ``mlp`` step, every core idle).
        deferred = counted and splittable and self.intra_op == "split" and self.active < self.cores
        if counted and not deferred:
            self.yield_point()
            if splittable and self.active > self.cores:
                self.wait_for_core()
        loop = None if counted else _get_running_loop()
        if loop is not None and splittable and self.loop_shares and self.active:
            held = _thread.hold
            if held is not None and held.budget is not self:
                held = None  # another budget's (tests make their own)
            own = held.units if held is not None else 0
            if self.active > own and (held is None or not own or held.lent):
                # Other threads compute (workers): one core for this product, as theirs
                # (``EnginePolicy.loop_shares_cores``). A hold this callback took (its first
                # product came while nothing else computed) goes on; one that an earlier
                # callback left lent ends here, or it would count this thread twice.
                if held is not None and own:
                    with self._lock:
                        self._drop_hold(held)
                splittable = False
                self.shared_products += 1
        if (
            loop is not None
            and flops >= self.min_split_flops
            and a.ndim >= 2
            and b.ndim == 2
            and _cuts_exactly(a, b)
        ):
            # A forward pass with products this large: its turns hold the cores
            # (``hold_for_turn``), even while a starved helper keeps them whole. Not one
            # whose products this BLAS cannot cut exactly: they run whole on the loop's
            # core, and a hold would only park the workers beside it.
            _thread.product_hold_at = time.perf_counter()
            _thread.product_hold_budget = self
        with self._lock:
            if self._holds and loop is None:
                self._expire_holds()
            hold = None
            if loop is not None and splittable and self.loop_hold_s > 0:
                hold = self._take_hold(loop)
            elif not counted:
                self._count(1)
            helpers: list[_Helper] = []
            blas_threads = 0  # >0: BLAS's own threads run this product ("blas" intra-op)
            extra = 0  # cores counted for this product's other threads
            if splittable:
                free = self.cores - 1 if loop is not None else self.cores - self.active
                wanted = min(free, split_size // align - 1)
                if wanted > 0 and self.intra_op == "blas" and self._blas is not None:
                    blas_threads = wanted + 1
                    extra = wanted  # the cores BLAS's threads take
                    self._blas.set(blas_threads)
                elif wanted > 0:
                    helpers = self._take_helpers(wanted)
                    extra = len(helpers)
                if hold is not None:
                    extra = 0  # within the hold
                self._count(extra)
        try:
            if helpers:
                return self._split(a, b, helpers, pause=deferred)
            if deferred:
                self.yield_point()
            slice_flops = self.lent_slice_flops if self._lent else self.slice_flops
            if counted and split_size >= 2 * align and flops >= 2 * slice_flops:
                return self._sliced(a, b, int(flops // slice_flops))
            return np.matmul(a, b)
        finally:
            with self._lock:
                if blas_threads and self._blas is not None:
                    self._blas.set(1)
                if hold is not None:
                    hold.until = time.perf_counter() + self.loop_hold_s
                    if self.lend_cores >= LEND_BETWEEN_PRODUCTS:
                        self._lend(hold)
                self._count(-(extra + (0 if counted or hold is not None else 1)))
                self._idle_helpers.extend(helpers)

    def matmul_pair(
        self,
        a1: np.ndarray[Any, Any],
        b1: np.ndarray[Any, Any],
        a2: np.ndarray[Any, Any],
        b2: np.ndarray[Any, Any],
    ) -> tuple[Any, Any]:
        """``(a1 @ b1, a2 @ b2)``: two independent products (a linear layer's input and
        weight gradients), side by side on this thread and a helper when a core is free.

        Splitting each product in turn over the cores costs more: twice the chunks, each a
        BLAS call of its own that packs its operands again (two 256x1024x1024 products on 2
        cores: 6.0 ms split against 5.8 ms paired on a quiet machine, 0.5 ms more CPU time),
        and a wait for the slowest chunk after each product. Each product is still cut in
        ``PAIR_CHUNKS`` chunks that either thread may claim, so that a helper another
        process starves holds back one chunk at most (a product this BLAS does not cut
        exactly is one chunk: each thread computes one product whole); the results are
        bitwise those of :meth:`matmul`. Only a counted thread (an engine worker) pairs;
        anywhere else, or when no core is free, this is two calls of :meth:`matmul`.
        """
        least = self.min_split_flops
        if (
            not _thread.counted
            or self.intra_op != "split"
            or not (_pairable(a1, b1, least) and _pairable(a2, b2, least))
            or time.perf_counter() < self._no_split_until
        ):
            return self.matmul(a1, b1), self.matmul(a2, b2)
        if self.active > self.cores:
            self.wait_for_core()
        with self._lock:
            helpers = self._take_helpers(1) if self.active < self.cores else []
            self._count(len(helpers))
        if not helpers:
            return self.matmul(a1, b1), self.matmul(a2, b2)
        try:
            # A pause point between two chunks (``_between_slices``): the pair keeps both
            # cores busy for two products, and without one the event loop's thread waited
            # for a core that long (aiohttp app, offload: /health p99 ~1 ms higher).
            between = self._between_slices
            first = _SplitProduct(a1, b1, PAIR_CHUNKS, between=between)
            second = _SplitProduct(a2, b2, PAIR_CHUNKS, between=between)
            # The helper starts on the second product and goes on with the first's chunks
            # that are left; this thread the other way round.
            self._place(helpers)
            helpers[0].inbox.put(second)
            helpers[0].inbox.put(first)
            self.yield_point()  # (the helper computes meanwhile)
            started = time.perf_counter()
            first.run_chunks()
            second.run_chunks()
            ran = time.perf_counter()
            first.wait()
            second.wait()
            self._note_helper_wait(ran - started, time.perf_counter() - ran, ran)
        finally:
            with self._lock:
                self._count(-1)
                self._idle_helpers.extend(helpers)
        self.paired_products += 1
        return first.out, second.out

    def _split(
        self,
        a: np.ndarray[Any, Any],
        b: np.ndarray[Any, Any],
        helpers: list[_Helper],
        pause: bool = False,
    ) -> np.ndarray[Any, Any]:
        threads = len(helpers) + 1
        per_thread = CHUNKS_PER_THREAD if _repacks_cheaply(a, b) else 1
        job = _SplitProduct(a, b, per_thread * threads)
        self._place(helpers)
        for helper in helpers:
            helper.inbox.put(job)
        if pause:
            self.yield_point()
        started = time.perf_counter()
        job.run_chunks()
        ran = time.perf_counter()
        job.wait()
        self._note_helper_wait(ran - started, time.perf_counter() - ran, ran)
        self.split_products += 1
        return job.out

    def _note_helper_wait(self, computed: float, waited: float, now: float) -> None:
        """After a split or paired product: the calling thread computed its chunks for
        ``computed`` seconds, then waited ``waited`` for the helpers' last chunks."""
        self.rest_point(waited)
        if waited > max(STARVED_WAIT_S, computed):
            # The helpers got no core in time. Once in a while is a hiccup of the machine;
            # several times in a row, other processes keep it busy: stop splitting for a
            # while, a starved helper only delays the product.
            self._starved += 1
            if self._starved >= STARVED_IN_A_ROW:
                self._starved = 0
                self.split_backoffs += 1
                self._no_split_until = now + waited + SPLIT_BACKOFF_S
        else:
            self._starved = 0

    def _sliced(
        self, a: np.ndarray[Any, Any], b: np.ndarray[Any, Any], slices: int
    ) -> np.ndarray[Any, Any]:
        """The product in sequential slices on this (counted) thread, with a yield point
        between them: while every core computes, one BLAS call of several milliseconds
        would keep the event loop's thread waiting for a core that long (the kernel lets the
        running thread finish its time slice, about 2.5 ms measured)."""
        job = _SplitProduct(a, b, slices, between=self._between_slices)
        job.run_chunks()
        job.wait()
        self.sliced_products += 1
        return job.out

    def _between_slices(self) -> None:
        self.yield_point()
        if self.active > self.cores:  # an event loop's thread wants the core: let it in
            self.wait_for_core()

    def _place(self, helpers: list[_Helper]) -> None:
        """Keep the helpers about to be woken off the calling thread's CPU (Linux).

        The caller computes its own chunks meanwhile, so a helper woken onto the caller's
        CPU waits for it. The kernel put it there although the other core was idle:
        measured on the 2-vCPU VM of benchmarks/README.md (session 25), a helper woken while
        its caller ran a 2.3 ms product started a median 1.7 ms later (p90 2.5 ms), once
        the idle core's balancer pulled it; kept off the caller's CPU, 0.1 ms. The affinity
        changes only when the caller's CPU does (a syscall of a few microseconds)."""
        if not self.place_helpers or _sched_getcpu is None:
            return
        cpu = _sched_getcpu()
        if cpu < 0:
            return
        for helper in helpers:
            if helper.avoided_cpu != cpu:
                helper.avoid_cpu(cpu)

    def _take_helpers(self, count: int) -> list[_Helper]:
        # Called with the lock held.
        while len(self._helpers) < self.cores - 1 and len(self._idle_helpers) < count:
            helper = _Helper(len(self._helpers))
            self._helpers.append(helper)
            self._idle_helpers.append(helper)
        taken = self._idle_helpers[-count:] if count else []
        del self._idle_helpers[len(self._idle_helpers) - len(taken) :]
        return taken


def _pairable(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any], min_flops: float) -> bool:
    """Whether ``a @ b`` is a large product that :meth:`CpuBudget.matmul_pair` may run beside
    another on two threads (floating point, ``a`` 2-D or batched, ``b`` 2-D): in chunks where
    this BLAS cuts it exactly (``_cuts_exactly``), else whole (one chunk: still exact, and
    the only parallelism left for a dtype this BLAS never cuts exactly)."""
    return (
        a.dtype.kind in "fc"
        and b.dtype.kind in "fc"
        and a.ndim >= 2
        and b.ndim == 2
        and a.shape[-1] == b.shape[0]
        and 2.0 * a.size * b.shape[1] >= min_flops
    )


def _cuts_exactly(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> bool:
    """Whether ``a @ b`` cut in blocks (``_SplitProduct``) is bitwise the whole product, as
    spec §5 requires (gradients do not depend on the load).

    Not with every BLAS kernel (``_cut_rule``, probed once per dtype), and not for
    every float64 product: OpenBLAS's dgemm rounds the output's last ``N % 8`` columns
    differently depending on where their rows fall in the call (row blocks and column
    blocks alike). Measured with OpenBLAS 0.3.31 (NumPy's wheel) on a SkylakeX core: 83 of
    the 204 float64 products tried, cut as ``_SplitProduct`` cuts them, differed from the whole
    ones, every one with ``N % 8 != 0``, in those columns only; none of the float32,
    complex64 and complex128 ones did."""
    dtype = np.result_type(a, b)
    return _cut_rule(dtype) is not None and (
        b.shape[-1] % F64_COLUMNS_ALIGN == 0 or dtype != np.float64
    )


def _repacks_cheaply(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> bool:
    """Whether ``a @ b`` may be split in ``CHUNKS_PER_THREAD`` chunks per thread: each
    chunk is a BLAS call of its own that packs the operand every chunk shares again (``b``
    for a product cut along its rows, ``a`` along its columns), which costs little while
    that operand is small (in the caches) and a pass over memory when it is not.

    Measured on OpenBLAS's Haswell sgemm (AMD EPYC, one thread, CPU time, session 29 of
    benchmarks/README.md): 256x784 @ 784x1024 cut along its rows took 4.61 ms whole, 4.84
    in 2 chunks and 5.07 in 4 (each chunk packs the 3.2 MB weight again), 256x1024 @
    1024x1024 6.05 / 6.18 / 6.57 ms; 784x256 @ 256x1024 (a 1 MB shared operand) 4.73 /
    4.68 / 4.69 ms."""
    by_rows, _, _ = _cut_plan(a, b)
    shared = b if by_rows else a
    return bool(shared.nbytes <= REPACK_CHEAP_BYTES)


def _cut_plan(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> tuple[bool, int, int]:
    """How ``_SplitProduct`` cuts ``a @ b`` (``a`` 2-D or batched, ``b`` 2-D): whether along
    the output's rows (else its columns), the length of that dimension (0: this BLAS does
    not cut the product exactly, it stays whole) and the multiple its cuts fall on."""
    rows, cols = a.shape[-2], b.shape[1]
    rule = _cut_rule(np.result_type(a, b)) if _cuts_exactly(a, b) else None
    if rule is None:
        return rows >= cols, 0, CHUNK_ALIGN
    align, rows_only = rule
    by_rows = rows_only or rows >= cols
    return by_rows, rows if by_rows else cols, align


def _cut_rule(dtype: np.dtype[Any]) -> tuple[int, bool] | None:
    """How this process's BLAS cuts products of ``dtype`` bitwise as whole ones: at multiples
    of how many rows or columns, and whether along the output's rows only; None: never
    (probed once per dtype)."""
    if dtype not in _EXACT_BLOCKS:
        if _blocks_are_exact(dtype):
            _EXACT_BLOCKS[dtype] = (CHUNK_ALIGN, False)
        elif _row_blocks_are_exact(dtype):
            _EXACT_BLOCKS[dtype] = (ROW_ALIGN, True)
        else:
            _EXACT_BLOCKS[dtype] = None
    return _EXACT_BLOCKS[dtype]


# dtype -> how this process's BLAS computes products cut in blocks bitwise as whole ones
# (``_cut_rule``)
_EXACT_BLOCKS: dict[np.dtype[Any], tuple[int, bool] | None] = {}


def _blocks_are_exact(dtype: np.dtype[Any]) -> bool:
    """Whether a small product cut in row blocks and in column blocks is bitwise the whole
    product with this BLAS and CPU, cut at ``CHUNK_ALIGN``. OpenBLAS's SkylakeX kernels pass
    for every dtype; its Haswell and Zen kernels (``OPENBLAS_CORETYPE=Haswell``: AMD CPUs,
    Intel without AVX-512) round float32 blocks cut there differently from the whole
    product (``_row_blocks_are_exact`` then). The probe (128x16 @ 16x128, under OpenBLAS's
    threshold for threads, so one thread whatever the setting) costs about 0.1 ms, once."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2 * CHUNK_ALIGN, 16)).astype(dtype)
    b = rng.standard_normal((16, 2 * CHUNK_ALIGN)).astype(dtype)
    whole = np.matmul(a, b)
    rows = np.concatenate([np.matmul(a[:CHUNK_ALIGN], b), np.matmul(a[CHUNK_ALIGN:], b)])
    columns = np.concatenate(
        [np.matmul(a, b[:, :CHUNK_ALIGN]), np.matmul(a, b[:, CHUNK_ALIGN:])], axis=1
    )
    return bool(np.array_equal(rows, whole) and np.array_equal(columns, whole))


def _row_blocks_are_exact(dtype: np.dtype[Any]) -> bool:
    """Whether a product cut in blocks of multiples of ``ROW_ALIGN`` output rows (the last
    block taking the remainder, as ``_SplitProduct`` cuts) is bitwise the whole product, for
    the operand layouts a linear layer's products take (each operand contiguous or a
    transposed view).

    OpenBLAS's Haswell and Zen sgemm (0.3.31, measured on an AMD EPYC, session 28 of
    benchmarks/README.md) computes the output's rows in groups of 12 (OpenBLAS's ``N``
    dimension: NumPy's row-major product is its column-major transpose): a cut at a multiple
    of 12 rows leaves every row in the same group as in the whole product, and then 2,512 of
    2,512 products cut by ``_SplitProduct`` were bitwise whole; cut at 64 or 128 rows, or
    along the columns at any multiple tried, none were. The probe (197x16 @ 16x64 cut in
    blocks of 12, 24, 48 and the rest, three layouts, under OpenBLAS's threshold for
    threads) costs about 0.1 ms, once per dtype."""
    rng = np.random.default_rng(1)
    rows = 16 * ROW_ALIGN + 5
    a = rng.standard_normal((rows, 16)).astype(dtype)
    b = rng.standard_normal((16, 64)).astype(dtype)
    bounds = [0, ROW_ALIGN, 3 * ROW_ALIGN, 7 * ROW_ALIGN, rows]
    for left, right in ((a, b), (np.asfortranarray(a), b), (a, np.asfortranarray(b))):
        whole = np.matmul(left, right)
        parts = [np.matmul(left[start:stop], right) for start, stop in itertools.pairwise(bounds)]
        if not np.array_equal(np.concatenate(parts), whole):
            return False
    return True


# Chunk boundaries are multiples of this many rows (columns): BLAS kernels work on blocks of
# up to 32 (OpenBLAS's sgemm on AVX-512), so every element of a chunk is computed exactly as
# in the whole product; a one-column chunk, say, would go through gemv and round differently.
CHUNK_ALIGN = 64
# ...or of this many rows only, on a BLAS that cuts exactly only there
# (``_row_blocks_are_exact``: OpenBLAS's Haswell sgemm computes rows in groups of 12). Cut
# at 48 instead, a 256-row product's 4 chunks were 48/48/48/112 rows: the thread with the
# last one computed 62% of the product, against 53% at 12 (60/60/60/76).
ROW_ALIGN = 12
# ...and hold at least this many multiply-adds: OpenBLAS computes small products (about
# 100x100x100 and below) with other kernels, whose rounding differs.
MIN_CHUNK_MACS = 1 << 21
# A float64 product is cut only if its output's columns are a multiple of this many
# (``_cuts_exactly``).
F64_COLUMNS_ALIGN = 8
# A split product is cut in this many chunks per thread, claimed one at a time: a thread that
# another process (or a higher priority) slows down delays the product by one chunk at most,
# instead of holding the others back for its whole share, as a static split (and OpenBLAS's
# own threads: 7.5 ms instead of 1.4 for 256x784 @ 784x512 with the other core busy) does.
# Each chunk packs its operands again, so more chunks cost more on a quiet machine: on 2 cores,
# 256x784 @ 784x1024 took 2.5 ms in 2 chunks, 2.7 in 8, 2.2-2.5 with OpenBLAS's 2 threads.
CHUNKS_PER_THREAD = 2
# ...or one chunk per thread when the operand every chunk packs again is larger than this
# (``_repacks_cheaply``): a weight matrix, not a batch of activations or gradients.
REPACK_CHEAP_BYTES = 2 << 20
# Each product of a pair (``CpuBudget.matmul_pair``) is cut in this many chunks: the pair then
# has CHUNKS_PER_THREAD chunks per thread on 2 cores, as one split product has.
PAIR_CHUNKS = 2
# A thread that asked for a split product and then waits for the helpers longer than this
# (and longer than it computed itself), STARVED_IN_A_ROW times in a row, concludes they are
# starved of CPU and computes whole products for SPLIT_BACKOFF_S: a quiet machine waits that
# long only in a rare hiccup of its scheduler (wake-ups of 0.1-0.2 ms are the rule on this
# VM); a loaded one (a busy server beside the training, other processes) would wait on every
# product.
STARVED_WAIT_S = 0.0005
STARVED_IN_A_ROW = 3
SPLIT_BACKOFF_S = 0.2
# An event loop's hold on the cores lasts this many loop iterations after the callback that
# computed (``CpuBudget._release_hold``; the default of ``EnginePolicy.loop_hold_iterations``).
HOLD_ITERATIONS = 2
# When an event loop's hold lends the cores it does not compute on (``CpuBudget._lend``):
# never, at the turn's start and once the callback that computed has returned (the default
# of ``EnginePolicy.loop_lends_cores``), or also between two products of one callback.
LEND_NEVER = 0
LEND_AFTER_CALLBACK = 1
LEND_BETWEEN_PRODUCTS = 2
# A coroutine's turn holds the cores (``CpuBudget.hold_for_turn``) only on a loop thread that
# ran a product large enough to split this recently: a training step's forward pass.
TURN_HOLD_MEMORY_S = 1.0


class _SplitProduct:
    """``out = a @ b`` (``a`` 2-D or batched, ``b`` 2-D) cut in blocks of the larger of the
    output's rows and columns, that threads claim until none is left."""

    def __init__(
        self,
        a: np.ndarray[Any, Any],
        b: np.ndarray[Any, Any],
        chunks: int,
        between: Callable[[], None] | None = None,
    ) -> None:
        cols = b.shape[1]
        out = np.empty((*a.shape[:-1], cols), dtype=np.result_type(a.dtype, b.dtype))
        self.out = out
        by_rows, size, align = _cut_plan(a, b)
        # Whole blocks; the last one takes the remainder: a chunk of a few rows or columns
        # goes through other kernels (a 129-column product cut at 64 and 128 rounded its last
        # column differently from the whole product).
        blocks = max(1, size // align) if size else 1
        size = size or (a.shape[-2] if by_rows else cols)
        macs_per_block = align * out.size // size * a.shape[-1]
        chunks = max(1, min(chunks, blocks, macs_per_block * blocks // MIN_CHUNK_MACS))
        # The larger chunks first: the calling thread claims the first, and the chunk
        # claimed last decides when the threads finish (21 blocks of 12 rows and 4 rows
        # more in 4 chunks: 72/60/60/64 rows, not 60/60/60/76; in 2: 132/124).
        stops = [-(-blocks * i // chunks) for i in range(1, chunks)]
        self._bounds = [0] + [align * stop for stop in stops] + [size]
        self._a, self._b, self._by_rows = a, b, by_rows
        self._lock = threading.Lock()
        self._next = 0
        self._left = len(self._bounds) - 1  # chunks not finished yet
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._between = between  # called between two chunks computed by one thread

    def run_chunks(self) -> None:
        """Compute chunks until none is left to claim (any thread)."""
        bounds = self._bounds
        first = True
        while True:
            with self._lock:
                index = self._next
                if index + 1 >= len(bounds):
                    return
                self._next = index + 1
            if not first and self._between is not None:
                self._between()
            first = False
            start, stop = bounds[index], bounds[index + 1]
            try:
                if self._by_rows:
                    np.matmul(
                        self._a[..., start:stop, :], self._b, out=self.out[..., start:stop, :]
                    )
                else:
                    np.matmul(self._a, self._b[:, start:stop], out=self.out[..., start:stop])
            except BaseException as exc:  # reported to the thread that asked for the product
                self._error = exc
            with self._lock:
                self._left -= 1
                if self._left == 0:
                    self._finished.set()

    def wait(self) -> None:
        """Block until every chunk is done (the chunks other threads are still computing)."""
        self._finished.wait()
        if self._error is not None:
            raise self._error


class _Helper:
    """A thread that computes chunks of split products (BLAS calls: it holds the GIL only
    briefly) and sleeps on its inbox between them, never spinning."""

    def __init__(self, index: int) -> None:
        self.inbox: queue.SimpleQueue[_SplitProduct] = queue.SimpleQueue()
        self.avoided_cpu = -1  # the CPU it may not run on (``CpuBudget._place``), -1: none
        self.thread = threading.Thread(
            target=self._main, name=f"aioautograd-intra-op-{index}", daemon=True
        )
        self.thread.start()

    def avoid_cpu(self, cpu: int) -> None:
        """Let the helper run on every CPU the process may use but ``cpu`` (the process's:
        the main thread's affinity, not the caller's, which may be pinned to ``cpu``)."""
        tid = self.thread.native_id
        try:
            allowed = os.sched_getaffinity(os.getpid()) - {cpu}
            if allowed and tid is not None:
                _set_affinity(tid, allowed)
        except OSError:  # a sandbox that forbids it, a CPU set that changed: leave it be
            return
        self.avoided_cpu = cpu

    def _main(self) -> None:
        register_engine_thread()  # its waits never ask a worker to pause
        drop_inherited_slice()
        # Created by whichever thread first split a product (maybe a worker at a lower
        # priority): run at the process's priority, so its chunks do not straggle.
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError):
                os.setpriority(
                    os.PRIO_PROCESS,
                    threading.get_native_id(),
                    os.getpriority(os.PRIO_PROCESS, os.getpid()),
                )
        while True:
            job = self.inbox.get()
            job.run_chunks()
            del job


def _libc_function(name: str, restype: Any, argtypes: list[Any]) -> Any:
    """glibc's ``name`` through ctypes (called without the GIL), or None where there is
    none to ask (not Linux, no C library found)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "sched_setaffinity"):
        return None
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    function.restype = restype
    function.argtypes = argtypes
    return function


# The CPU the calling thread runs on (~0.5 µs through ctypes).
_sched_getcpu: Callable[[], int] | None = _libc_function("sched_getcpu", ctypes.c_int, [])
# A thread's affinity, set without holding the GIL (``_set_affinity``).
_sched_setaffinity = _libc_function(
    "sched_setaffinity", ctypes.c_int, [ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p]
)
_MASK_WORD_BITS = 8 * ctypes.sizeof(ctypes.c_ulong)


def _set_affinity(tid: int, cpus: set[int]) -> None:
    """Let thread ``tid`` run on ``cpus`` only, without holding the GIL meanwhile.

    ``os.sched_setaffinity`` holds the GIL for the whole system call, and moving a thread
    off a CPU it is running or queued on waits for the kernel's migration: measured on the
    2-vCPU VM of benchmarks/README.md under load (session 26), a helper's placement during
    offloaded training steps took 15-16 µs at the median but 1.5-89 ms a few times per 100
    steps, all that time with the GIL held and the event loop's thread waiting for it."""
    function = _sched_setaffinity
    if function is None:
        os.sched_setaffinity(tid, cpus)
        return
    words = max(1024, max(cpus) + 1) // _MASK_WORD_BITS + 1
    mask = (ctypes.c_ulong * words)()
    for cpu in cpus:
        mask[cpu // _MASK_WORD_BITS] |= 1 << (cpu % _MASK_WORD_BITS)
    if function(tid, ctypes.sizeof(mask), mask) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


_budget: CpuBudget | None = None
_budget_lock = threading.Lock()


def cpu_budget() -> CpuBudget:
    """The process's CPU budget, configured by the default engine's policy."""
    budget = _budget
    if budget is None:
        from aioautograd.engine.policy import EnginePolicy

        budget = configure(EnginePolicy(), only_if_unset=True)
    return budget


def configure(policy: Any, only_if_unset: bool = False) -> CpuBudget:
    """Apply an ``EnginePolicy`` to the process's budget (``set_default_engine`` does this).

    The budget is updated in place: threads counted now stay counted, helpers are reused.
    """
    global _budget
    cores = max(1, policy.cpu_cores or usable_cores())
    with _budget_lock:
        budget = _budget
        if budget is None:
            budget = _budget = CpuBudget(
                cores,
                policy.intra_op_min_flops,
                policy.blas_min_flops,
                manage_blas=policy.manage_blas_threads,
            )
        elif only_if_unset:
            return budget
    # Made outside the lock: the first one may wait for OpenBLAS's pool (``blas_pool``).
    blas = _BlasThreads() if policy.manage_blas_threads and budget._blas is None else None
    with budget._lock:
        budget.cores = cores
        budget.min_split_flops = policy.intra_op_min_flops
        budget.min_counted_flops = policy.blas_min_flops
        budget.intra_op = policy.intra_op
        budget.slice_flops = policy.product_slice_flops
        budget.loop_hold_s = policy.loop_hold_s
        budget.place_helpers = policy.place_helpers
        budget.hold_iterations = policy.loop_hold_iterations
        budget.lend_cores = LEND_AFTER_CALLBACK if policy.loop_lends_cores else LEND_NEVER
        budget.lent_slice_flops = policy.lent_slice_flops
        budget.loop_shares = policy.loop_shares_cores
        if policy.manage_blas_threads and budget._blas is None:
            budget._blas = blas if blas is not None else _BlasThreads()
            budget._user_blas_threads = budget._blas.get()
        elif not policy.manage_blas_threads and budget._blas is not None:
            if budget.active > 0:
                budget._blas.set(budget._user_blas_threads)
            budget._blas = None
        budget._slot_free.notify_all()
    if policy.keep_freed_memory:
        keep_freed_memory()
    return budget
