"""A forgotten ``await`` on ``backward()`` is an error, not a silent no-op.

``loss.backward()`` returns a coroutine: called without ``await`` it never runs, the
gradients stay ``None`` and ``optimizer.step()`` would silently do nothing (Python only warns
when the coroutine is garbage collected). So each backward coroutine is remembered, for the
task (or, without a running loop, the thread) that made it, until it starts; reading
``.grad`` (which ``optimizer.step()`` and ``zero_grad()`` do) while the current task holds one
that never started raises an error that says to ``await`` it.

The cost is one list append per backward call, undone when the coroutine starts (and, where
it was not the latest entry, one pass over that short list on the next ``.grad`` read);
nothing per node, no lock, no loop round-trip. The coroutine stays a plain
coroutine, so ``asyncio.gather``, ``create_task`` and ``wait_for`` work on it as before.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _Pending(threading.local):
    def __init__(self) -> None:
        # (owner task or None, coroutine, what was called) for backward calls not yet started.
        self.items: list[tuple[object, Coroutine[Any, Any, Any], str]] = []


_pending = _Pending()


def _owner() -> object:
    loop = asyncio._get_running_loop()
    return None if loop is None else asyncio.current_task(loop)


def _started(coroutine: Coroutine[Any, Any, Any]) -> bool:
    # CORO_CREATED is the only state with a frame that is neither running nor suspended.
    return coroutine.cr_frame is None or coroutine.cr_running or coroutine.cr_suspended  # type: ignore[attr-defined]


def track(coroutine: Coroutine[Any, Any, T], call: str) -> Coroutine[Any, Any, T]:
    """Remember ``coroutine`` (a backward pass, ``call`` as the user writes it) until it
    starts; return it."""
    items = _pending.items
    if len(items) > 8:  # the next .grad read prunes it; code that never reads .grad needs this
        items[:] = [item for item in items if not _started(item[1])]
    items.append((_owner(), coroutine, call))
    return coroutine


def forget_running() -> None:
    """(first thing a tracked coroutine runs) Forget its entry when it is the latest, as it
    usually is: it has started, so the next ``.grad`` read would only prune it."""
    items = _pending.items
    if items and items[-1][1].cr_running:  # type: ignore[attr-defined]
        del items[-1]


def check_awaited() -> None:
    """Raise if the current task called ``backward()`` without awaiting it.

    Called on ``.grad`` reads while a backward coroutine is remembered (a cheap check first).

    Raises:
        RuntimeError: naming the call and saying to ``await`` it.
    """
    items = _pending.items
    items[:] = [item for item in items if not _started(item[1])]
    if not items:
        return
    owner = _owner()
    for task, coroutine, call in items:
        if task is owner:
            # Close it: it can never run usefully now, and Python's "never awaited" warning
            # at garbage collection would only repeat this error later.
            root = _describe_root(coroutine)
            items.remove((task, coroutine, call))
            coroutine.close()
            raise RuntimeError(
                f"{call}{root} was called without `await`: it returns a coroutine, which "
                "never ran, so no gradient was computed (.grad is unchanged and "
                f"optimizer.step() would do nothing). Write `await {call}` inside a "
                "coroutine, or use the blocking `backward_sync()` where no event loop runs."
            )


def _describe_root(coroutine: Coroutine[Any, Any, Any]) -> str:
    frame = coroutine.cr_frame  # type: ignore[attr-defined]
    roots = frame.f_locals.get("tensors") if frame is not None else None
    grad_fn = getattr(roots, "grad_fn", None)
    return f" (on a tensor with grad_fn=<{grad_fn.name()}>)" if grad_fn is not None else ""
