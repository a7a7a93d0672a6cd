"""Small asyncio helpers shared by the engine and the RPC layer."""

from __future__ import annotations

import asyncio


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running on this thread, or ``None``."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def ensure_no_running_loop(what: str, instead: str) -> None:
    """Refuse a blocking call (``what``) on a thread that runs an event loop.

    Raises:
        RuntimeError: naming the call and the coroutine to ``await`` ``instead``.
    """
    if running_loop() is not None:
        raise RuntimeError(
            f"{what} called from a thread that is running an event loop: it would block the "
            f"loop. Use the coroutine instead: {instead}."
        )
