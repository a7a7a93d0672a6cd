"""Which threads may want the GIL or a core: what lets a worker skip a pause nobody needs."""

from __future__ import annotations

import contextlib
import selectors
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from aioautograd.devices import gil_waiters

linux_only = pytest.mark.skipif(
    not gil_waiters._SUPPORTED, reason="the threads' wait channels are read from Linux's /proc"
)


@contextlib.contextmanager
def _thread_in(wait: Callable[[threading.Event], None]) -> Iterator[threading.Thread]:
    """A thread that runs ``wait(stop)`` until the test sets ``stop``; yielded once it has
    had time to block."""
    stop = threading.Event()
    thread = threading.Thread(target=wait, args=(stop,), daemon=True)
    thread.start()
    time.sleep(0.05)
    try:
        yield thread
    finally:
        stop.set()
        thread.join(timeout=10)


def _settled(thread: threading.Thread) -> bool:
    """``thread_may_wait`` for a thread that keeps going back to the same wait: asked a few
    times, so that a moment it spends between two waits is not what the test sees."""
    assert thread.native_id is not None
    answers = []
    for _ in range(5):
        answers.append(gil_waiters.thread_may_wait(thread.native_id))
        time.sleep(0.01)
    return max(set(answers), key=answers.count)


@linux_only
@pytest.mark.timeout(30)
def test_a_thread_asleep_in_epoll_or_a_sleep_does_not_want_the_gil() -> None:
    def in_epoll(stop: threading.Event) -> None:
        with selectors.DefaultSelector() as selector:
            while not stop.is_set():
                selector.select(0.5)

    def in_sleep(stop: threading.Event) -> None:
        while not stop.is_set():
            time.sleep(0.5)

    for wait in (in_epoll, in_sleep):
        with _thread_in(wait) as thread:
            assert _settled(thread) is False, wait.__name__


@linux_only
@pytest.mark.timeout(30)
def test_a_thread_blocked_on_a_lock_or_computing_may_want_the_gil() -> None:
    def on_event(stop: threading.Event) -> None:
        stop.wait()

    def computing(stop: threading.Event) -> None:
        while not stop.is_set():  # pure Python: it wants the GIL whenever it lacks it
            sum(range(1000))

    for wait in (on_event, computing):
        with _thread_in(wait) as thread:
            assert _settled(thread) is True, wait.__name__


@linux_only
@pytest.mark.timeout(30)
def test_an_exited_thread_is_not_read_again_and_its_file_is_closed() -> None:
    thread = threading.Thread(target=time.sleep, args=(0.01,))
    thread.start()
    tid = thread.native_id
    assert tid is not None
    gil_waiters.thread_may_wait(tid)  # opens its file
    assert tid in gil_waiters._wchan_files
    thread.join(timeout=10)
    gil_waiters.others_may_wait()  # notices it has gone
    assert tid not in gil_waiters._wchan_files


def test_the_engines_own_threads_and_the_caller_are_never_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[int] = []
    monkeypatch.setattr(gil_waiters, "_SUPPORTED", True)
    monkeypatch.setattr(gil_waiters, "thread_may_wait", lambda tid: asked.append(tid) or False)
    ready = threading.Event()
    stop = threading.Event()

    def engine_thread() -> None:
        gil_waiters.register_engine_thread()
        try:
            ready.set()
            stop.wait()
        finally:
            gil_waiters.forget_engine_thread()

    thread = threading.Thread(target=engine_thread, daemon=True)
    thread.start()
    assert ready.wait(timeout=10)
    try:
        assert gil_waiters.others_may_wait() is False
        assert thread.native_id not in asked
        assert threading.get_native_id() not in asked
    finally:
        stop.set()
        thread.join(timeout=10)
    assert thread.native_id not in gil_waiters._engine_threads


def test_elsewhere_than_linux_every_thread_may_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gil_waiters, "_SUPPORTED", False)
    assert gil_waiters.others_may_wait() is True
    assert gil_waiters.thread_may_wait(threading.get_native_id()) is True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's /proc")
def test_an_unreadable_thread_may_wait() -> None:
    assert gil_waiters.thread_may_wait(2**22 + 12345) is True  # no such thread


def test_with_many_other_threads_every_due_pause_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []
    monkeypatch.setattr(gil_waiters, "_SUPPORTED", True)
    monkeypatch.setattr(gil_waiters, "thread_may_wait", lambda tid: asked.append(tid) or False)

    def threads(count: int) -> list[object]:  # stand-ins for other Python threads, all idle
        # (ids no real thread has: neither the caller nor one of the engine's)
        return [type("Idle", (), {"native_id": 2**40 + i})() for i in range(count)]

    monkeypatch.setattr(threading, "enumerate", lambda: threads(gil_waiters._MAX_PROBES))
    assert gil_waiters.others_may_wait() is False  # each one asked, none waits
    assert len(asked) == gil_waiters._MAX_PROBES
    asked.clear()
    monkeypatch.setattr(threading, "enumerate", lambda: threads(gil_waiters._MAX_PROBES + 1))
    assert gil_waiters.others_may_wait() is True  # too many to ask: pause
    assert len(asked) == gil_waiters._MAX_PROBES


@linux_only
@pytest.mark.timeout(60)
def test_a_forked_child_forgets_its_parents_threads() -> None:
    import os

    gil_waiters.register_engine_thread()
    try:
        gil_waiters.thread_may_wait(threading.get_native_id())  # an open file
        assert gil_waiters._wchan_files
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report what it kept, then leave at once
            kept = len(gil_waiters._engine_threads) + len(gil_waiters._wchan_files)
            os.write(write, bytes([min(kept, 255)]))
            os._exit(0)
        os.close(write)
        try:
            assert os.read(read, 1) == b"\x00"
        finally:
            os.close(read)
            os.waitpid(pid, 0)
    finally:
        gil_waiters.forget_engine_thread()
