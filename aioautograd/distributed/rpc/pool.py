"""The threads that run plain (non-``async``) remote functions.

Like :class:`concurrent.futures.ThreadPoolExecutor`, except that work whose caller gave up
(its call timed out or was cancelled) stops counting against the pool's size: a thread
cannot be interrupted, so it finishes that work, but the pool starts another thread in its
place meanwhile. Timed-out calls therefore never hold back later ones; the threads beyond
the size exit once they are idle. The threads are daemons, so that abandoned work never
keeps a process from exiting.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class WorkerPool:
    """``size`` threads for plain remote functions, plus one per abandoned piece of work."""

    def __init__(self, size: int, name: str) -> None:
        if size < 1:
            raise ValueError(f"num_worker_threads must be at least 1, got {size}")
        self._size = size
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None]
        self._jobs = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = threading.Semaphore(0)
        self._threads = 0
        self._abandoned: set[Future[Any]] = set()
        self._closed = False

    @property
    def threads(self) -> int:
        """Threads alive now (busy or idle)."""
        return self._threads

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn()`` on a pool thread; returns its future."""
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the RPC worker pool has shut down")
            self._jobs.put((future, fn))
            if not self._idle.acquire(blocking=False):
                self._grow()
        return future

    def abandon(self, future: Future[Any]) -> None:
        """The caller no longer waits for ``future``: its thread stops counting."""
        if future.cancel():
            return  # it had not started: nothing holds a thread
        with self._lock:
            if future.done() or self._closed:
                return
            self._abandoned.add(future)
            self._grow()

    def _grow(self) -> None:
        # Called with the lock held.
        if self._threads - len(self._abandoned) >= self._size:
            return
        self._threads += 1
        thread = threading.Thread(
            target=self._work, name=f"{self._name}_{self._threads}", daemon=True
        )
        thread.start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn = job
            if future.set_running_or_notify_cancel():
                try:
                    result = fn()
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            with self._lock:
                self._abandoned.discard(future)
                if self._closed or self._threads - len(self._abandoned) > self._size:
                    self._threads -= 1  # a stand-in no longer needed
                    return
            self._idle.release()

    def shutdown(self) -> None:
        """Cancel the work not started yet and let the threads end (does not wait)."""
        with self._lock:
            self._closed = True
            threads = self._threads
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in range(threads):
            self._jobs.put(None)
