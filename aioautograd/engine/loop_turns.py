"""Backward passes that finish together hand control back to their coroutines one loop
turn at a time (event loop side only).

Why: in natural training code each coroutine runs ``optimizer.step()`` and the next forward
between two ``await loss.backward()``: a few milliseconds of work on the loop. When several
passes complete at once (four models trained together), asyncio would resume all their
coroutines in one iteration, back to back, and a timer or an I/O callback due meanwhile (a
heartbeat, a health check) would wait for all of them. Here the first coroutine resumes at
once; each of the others waits for a release that is scheduled as a timer due *now*, so it
runs after every callback and timer already due: at most one coroutine's work stands between
the loop and its other duties.

The release hands the turn on one loop iteration after its timer fires. A timer that fell
due during a coroutine's work (``asyncio.sleep`` ending) only schedules its task's wake-up,
which runs an iteration later; a backward pass that completed meanwhile had its coroutine's
wake-up scheduled earlier still. Handing the turn on in the timer's own iteration let that
coroutine run its work before the sleeper woke: two coroutines' work back to back (a 1 ms
ticker 10-14 ms late in ``concurrent``, natural code).

The first coroutine to resume waits for a timer due now as well: it goes after every timer
already due (and after the wake-ups they schedule, which asyncio runs an iteration after
the timer). A completion wakes the loop through its self-pipe, and asyncio runs the
callbacks that thread queued before the timers that fell due meanwhile, and a timer's
sleeper wakes one iteration after its timer fires: when a backward pass completed about
when a sleeper's timer fell due (or while the loop was blocked, or with a request's I/O),
the coroutine resumed first and its step and forward pass ran before the sleeper woke.
Traced in ``concurrent`` (natural code, ``benchmarks/loop_trace.py``): most ticks over
8 ms late had a completion resolved within 0.3 ms of the tick's due time, the turn (7-10
ms) starting before the tick. The hop costs two loop iterations per awaited backward that
went to the executors (7-9 µs per turn with the release in a micro-benchmark, as before
it: the release's own iterations come first now). Its release is scheduled after the hop, as
its work starts: scheduled before, the release fired right after the work and handed the
turn to the next coroutine ahead of a sleeper that fell due during it.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque


class LoopTurns:
    """The turn-taking state of one event loop (see module docstring)."""

    __slots__ = ("__weakref__", "_armed", "_loop", "_release_soon", "_waiters")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._armed = False  # a release is scheduled: someone resumed in this turn
        self._release_soon = lambda: loop.call_soon(self._release)

    async def take_turn(self) -> None:
        """Go after every timer already due if no coroutine resumed from a backward pass in
        this turn, else wait for a later turn (FIFO)."""
        if not self._armed:
            self._armed = True  # coroutines resumed meanwhile wait behind this one
            hop = self._loop.create_future()
            self._loop.call_at(self._loop.time(), _resolve, hop)  # see the module docstring
            try:
                await hop
            finally:
                self._arm()  # as its work starts (cancelled: hands the turn on)
            return
        waiter = self._loop.create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._arm()  # the turn had been handed to us: hand it on
            raise
        # Armed now, as this coroutine's work starts: the next waiter's release is due before
        # any timer that falls due during that work, and goes after it.
        self._arm()

    def _arm(self) -> None:
        self._armed = True
        loop = self._loop
        loop.call_at(loop.time(), self._release_soon)

    def _release(self) -> None:
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # stays armed: the woken coroutine arms the next
                return
        self._armed = False


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


_turns: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopTurns] = (
    weakref.WeakKeyDictionary()
)


def loop_turns(loop: asyncio.AbstractEventLoop) -> LoopTurns:
    """The turn-taking state of ``loop`` (made on first use; only that loop's thread calls)."""
    turns = _turns.get(loop)
    if turns is None:
        turns = _turns[loop] = LoopTurns(loop)
    return turns
