"""`EnginePolicy`: every scheduling heuristic of the engine, in one place, with its reason.

Each default was set by a figure of ``benchmarks/run.py`` (named beside it) on a 2-core
machine in the default environment; ``benchmarks/README.md`` records the runs. Change them
through ``Engine(policy=...)`` and ``set_default_engine``, never by editing constants
elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

# NumPy's floating-point error handling wherever the engine runs nodes. Backward formulas
# evaluate masked-out branches (pow at 0, log of a clamped value): like PyTorch, they produce
# inf/nan silently instead of NumPy warnings. Executor threads set it once per thread
# (``numpy.seterr``, no per-node cost); inline execution on the loop's thread wraps its run
# in ``numpy.errstate`` (the loop's own setting is restored). An ``async`` node's backward is
# user code awaited on the user's loop and keeps the caller's setting: ``errstate`` across an
# ``await`` is task-safe only from NumPy 2.0, and the package supports 1.26.
NUMPY_ERRORS: Final = "ignore"

# A worker whose wait for a task lasted more than this fraction of ``gil_hold_s`` slept
# without the GIL: its hold starts afresh (``Executor._next_task``).
SLEPT_FRACTION_OF_HOLD: Final = 0.25

# A worker that blocked at least this long (and ``gil_pause_s``) waiting for the helpers of a
# split product counts as having paused (``executor.rested``): the pause's 20 µs sleep lasts
# about 0.1 ms with Linux's default 50 µs timer slack, the window that lets the event loop's
# thread in (shorter sleeps worsened the ``concurrent`` heartbeat's p99).
RESTED_S: Final = 0.0001


@dataclass(frozen=True, slots=True)
class EnginePolicy:
    """How an :class:`~aioautograd.engine.Engine` uses the machine.

    Attributes:
        cpu_threads: CPU executor worker threads (``None``: the usable cores, at least 2 so
            that an ``async`` node's continuation never waits behind a long node).
        cpu_cores: threads that may compute at once, workers, callers and intra-op helpers
            together (``None``: the usable cores). See ``devices/cpu_budget.py``.
        manage_blas_threads: keep NumPy's BLAS on one thread while aioautograd computes and
            split large products over idle cores itself (``concurrent``: 4x slower with
            BLAS's own threads on 2 cores); the process's BLAS setting is restored whenever
            no aioautograd thread computes. OpenBLAS's pool is also restarted once with a
            ~0.4 ms idle spin instead of ~0.1 s (``devices/blas_pool.py``), unless a timeout
            is set in the environment.
        intra_op: how a large product uses idle cores: ``"split"`` cuts it into blocks that
            the budget's helper threads claim (robust when other load takes a core: a slow
            helper delays one block, and a starved one stops the splitting), ``"blas"`` lets
            BLAS's own threads run it (their static split waits for the slowest thread, and
            they spin for ~0.1 s afterwards, and their rounding depends on the thread count,
            so gradients are no longer bitwise independent of the load; but on a quiet
            machine they pack operands once).
        intra_op_min_flops: products of at least this many floating-point operations are
            split over idle cores (about 0.15 ms on one core; waking a helper costs ~40 µs;
            ``mlp``).
        place_helpers: keep an intra-op helper off the CPU of the thread that wakes it for a
            split or paired product (Linux; its affinity is changed only when that CPU
            changes). The caller computes its own chunks meanwhile, and the kernel may queue
            the woken helper behind it although another core is idle: on the 2-vCPU VM of
            ``benchmarks/README.md`` (session 25) a helper woken during a 2.3 ms product
            started a median 1.7 ms later, against 0.1 ms kept off the caller's CPU.
        blas_min_flops: products below this are left alone, uncounted: OpenBLAS runs them on
            one thread anyway (its threshold is m·n·k < 262,144).
        product_slice_flops: a worker's product that is not split (every core busy) is
            computed in sequential slices of about this many operations (~1 ms on one
            core), with a pause check between them: the kernel let a worker's 2-3 ms BLAS
            call finish its time slice before the event loop's thread got the core
            (``concurrent``, offload step: heartbeat p99 2.6 ms whatever ``gil_hold_s``).
        loop_hold_s: with ``loop_shares_cores`` off, an event loop's thread that runs a large
            product (a forward pass in a coroutine) holds every core until its current
            callback returns to the loop (and ``loop_hold_iterations`` more loop iterations),
            or for at most this long after its last product: the engine's workers give up
            theirs at their next node or product slice, and stay off the cores between the
            forward pass's products instead of coming back for each gap between them
            (``concurrent``, natural code: forward passes on the loop took 4-8 ms instead of
            ~2.5 while workers kept coming back). A coroutine resumed from an awaited CPU
            backward takes the same hold at once while workers compute (its optimizer step
            and next forward pass follow on the loop: see ``CpuBudget.hold_for_turn``),
            lapsing after this long if no product comes. 0: only each product is urgent.
            With ``loop_shares_cores`` (the default), a loop's product takes this hold only
            when no other thread computes.
        loop_hold_iterations: the loop's hold lasts this many loop iterations after the
            callback that computed (unless ``loop_hold_s`` lapses first): a request read
            while a forward pass ran is handled in the next two (its reader callback, then
            the task it wakes), and released earlier, the backward pass just started took
            both cores and the loop's thread waited for one to answer (aiohttp app, natural
            code: see benchmarks/README.md, session 24). 0: the hold ends as that callback
            returns.
        loop_lends_cores: while the loop's hold has no product to compute (the turn's start,
            where natural code runs its optimizer step, and the loop iterations after the
            callback that computed), the loop's thread counts one core and lends the others
            to parked workers; its next product takes them back, and a worker lent a core
            leaves at its next node or slice of ``lent_slice_flops``. Without it the hold
            parked every worker for the whole turn (``concurrent``, natural code: a core
            left free for 84 ms of a 300 ms run, benchmarks/README.md session 26).
        lent_slice_flops: a worker's product computed while a loop lends it a core is cut
            in sequential slices of about this many operations (~0.3 ms on one core): the
            longest the loop's next product waits for that core.
        loop_shares_cores: an event loop's thread that runs a large product while other
            threads compute takes one core for it, as any other thread does, instead of
            holding every core for its callback (``loop_hold_s``; a coroutine's turn takes
            no hold either): the workers keep computing through the loop's forward pass,
            whose products run whole on the loop's thread, at one core's speed. Alone (no
            other thread computing), its products still take every core and the hold. On by
            default since session 35: four models trained at once with natural code
            (``concurrent``) took 11-26% less wall time than with the hold in nine rounds
            out of nine (0.95-1.29x the sequential schedule, against 0.83-1.13x), and the
            aiohttp app's natural mode was level (steps/s and ``/health`` p99 within the
            rounds' spread). The price is the loop's latency while other passes compute:
            the 1 ms heartbeat's p99 17-30 ms instead of 12-22 ms (benchmarks/README.md,
            session 35; session 27 found the same trade). Off: a forward pass on the loop
            gets every core at once, for a program that serves requests on its loop beside
            training and keeps its forward passes there; ``offload`` is the way to keep the
            loop free either way (heartbeat p99 under 2 ms).
        loop_slice_s: while a thread awaits an ``offload`` (an event loop's thread with
            the training step on a worker), it asks the kernel for a scheduler slice this
            short (Linux 6.12+, ``sched_attr.sched_runtime``; its weight, and so its share of
            the CPU and the workers', is unchanged), and gets its own slice back when no
            call is in flight. When it wakes while the workers keep every core busy it gets one
            at once instead of after a worker's slice or the next tick (``concurrent``,
            offload step: the 1 ms heartbeat's ticks later than 2 ms halved; benchmarks/
            README.md, s30-t12). Not taken for an awaited backward: a loop that computes
            its forward pass is preempted by every thread woken on its CPU then (natural
            code 10-20% slower). 0 leaves the thread alone, as the engine does a thread that
            is not ``SCHED_OTHER`` or whose slice is already that short
            (``devices/thread_slice.py``).
        worker_nice: CPU workers run this much below the process's priority (Linux). 0 by
            default: at +10 the workers lost most of their CPU to any other busy process
            (the aiohttp app under wrk load trained at 5 steps/s instead of 21), while the
            loop's latency on an otherwise idle machine was the same at 0 and +10 once the
            budget removed BLAS's spinning threads (``stall``, ``concurrent``); the workers'
            pauses (``gil_hold_s``) let the loop in.
        inline_budget_s: an awaited CPU backward runs its small nodes on the awaiting thread
            for at most this long before handing the rest to the executors (0 disables).
            Saves the two thread hand-offs of a tiny backward (``small_mlp``).
        inline_max_nodes: graphs with more nodes never start inline (walking them alone
            would approach the budget).
        inline_max_elements: a node runs inline only if the gradients it reads and writes
            have at most this many elements, each counted ``Node._element_cost`` times for
            the node classes far dearer per element than a multiplication (GELU's 64, a
            scatter-add's 4): at this limit every node class measured took at most ~0.2 ms
            on one core of the 2-vCPU VM (a ReLU 35-60 µs; ``inline_limits``, session 27
            of ``benchmarks/README.md``).
        inline_max_flops: a node whose backward is matrix products (``matmul``, ``linear``)
            runs inline only if they take at most this many floating-point operations,
            counted as float32 ones (a float64 one counts 2, a complex128 one 8, one in a
            dtype without a BLAS kernel such as float16 256): 1.2e7 is ~0.2 ms on one core
            of that VM (``inline_limits``), so the loop is held at most the budget plus one
            such node. It lets the model-parallel step's 600x64 ``linear`` backward (9.8
            MFLOP) and the element-wise nodes around it run on the loop instead of paying
            two thread hand-offs per pass on each worker (``model_parallel``).
        gil_hold_s: a worker lets other threads take the GIL, and a core, after running
            this long (checked after every node, and before every large product and between
            the slices of one): CPython's switch interval is 5 ms, and with every core busy
            the kernel took 2.5-4 ms to give the event loop's thread one. ``concurrent``
            with offloaded steps, heartbeat p99 with product slices: 2.5 ms at 2 ms, 1.8 ms
            at 1 ms, 1.7 ms at 0.5 ms, wall times within 4% of each other.
        gil_pause_s: how long it lets them.
        gil_pause_always: pause even when no other Python thread waits for the GIL or a
            core. By default a due pause is skipped then (``devices/gil_waiters.py``: the
            threads' kernel wait channels, on Linux): on the 2-core VM the 20 µs sleep took
            ~100 µs, and up to a scheduler slice under load, ~50 times per 10,000-node
            ``chain`` (7-25% of its time) while the loop only waited for the result.
        blocked_node_s: when every CPU worker has been busy this long while backward tasks
            wait without one being taken, the engine warns (``BlockedWorkerWarning``,
            naming the nodes that hold the workers: usually a backward that waits on a
            lock, an event or I/O) and, unless those workers used the CPU meanwhile,
            starts an extra worker, outside the CPU budget, that serves the queue until
            it is empty (``engine/watchdog.py``). 0 disables.
        keep_freed_memory: set glibc's ``malloc`` to keep up to 64 MiB of freed memory for
            reuse (mmap threshold 32 MiB, trim threshold 64 MiB: where glibc's own adaptive
            rule ends), when this policy configures the CPU budget (the first product, or
            ``set_default_engine``). A step that frees arrays of a few hundred KB otherwise
            hands them back to the kernel and faults them in again: the flagship example's
            model took ~420 page faults per step and ran 30-40% longer per step (session 32).
            Process-wide, and not undone by a later policy; skipped without glibc and when
            the environment sets malloc's thresholds itself (``MALLOC_*_`` variables,
            ``GLIBC_TUNABLES``). See ``devices/memory.py``.
    """

    cpu_threads: int | None = None
    cpu_cores: int | None = None
    manage_blas_threads: bool = True
    intra_op: str = "split"
    intra_op_min_flops: float = 3.0e7
    place_helpers: bool = True
    blas_min_flops: float = 524_288.0
    product_slice_flops: float = 1.0e8
    loop_hold_s: float = 0.001
    loop_hold_iterations: int = 2
    loop_lends_cores: bool = True
    lent_slice_flops: float = 2.5e7
    loop_shares_cores: bool = True
    loop_slice_s: float = 0.0001
    worker_nice: int = 0
    inline_budget_s: float = 0.0005
    inline_max_nodes: int = 256
    inline_max_elements: int = 1 << 17
    inline_max_flops: float = 1.2e7
    gil_hold_s: float = 0.001
    gil_pause_s: float = 0.00002
    gil_pause_always: bool = False
    blocked_node_s: float = 1.0
    keep_freed_memory: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.loop_slice_s < float("inf"):
            raise ValueError(
                f"EnginePolicy.loop_slice_s must be a finite number of seconds >= 0 "
                f"(0 leaves the loop's thread alone), got {self.loop_slice_s!r}"
            )
