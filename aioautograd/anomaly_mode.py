"""Anomaly mode, held in ``ContextVar``s: trace capture and the NaN check are separate switches.

With trace capture on, every node records the stack of the forward call that created it, and
an error raised in its backward carries that traceback as a note. With the NaN check on, a node
whose backward returns NaN fails the graph task with PyTorch's message.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from contextvars import ContextVar, Token
from typing import Any, NamedTuple, TypeVar, cast

F = TypeVar("F", bound=Callable[..., Any])


class AnomalyMode(NamedTuple):
    enabled: bool
    check_nan: bool


_OFF = AnomalyMode(False, True)
_anomaly: ContextVar[AnomalyMode] = ContextVar("anomaly_mode", default=_OFF)
# In anomaly mode, the backward node being evaluated: nodes created while it runs (double
# backward) record it as their parent, so a failure can report the chain that induced it.
current_node: ContextVar[Any] = ContextVar("anomaly_current_node", default=None)


def is_anomaly_enabled() -> bool:
    """Whether forward tracebacks are recorded in the current context."""
    return _anomaly.get().enabled


def is_anomaly_check_nan_enabled() -> bool:
    """Whether backward outputs are checked for NaN in the current context."""
    mode = _anomaly.get()
    return mode.enabled and mode.check_nan


def current_anomaly_mode() -> AnomalyMode:
    return _anomaly.get()


class detect_anomaly:
    """Enable anomaly detection for the enclosed code (context manager or decorator).

    Args:
        check_nan: also fail a backward node that returns NaN values ("Function
            'MulBackward0' returned nan values in its 0th output.").

    Anomaly mode is slow; use it to debug. It is scoped to the current task/context.
    """

    def __init__(self, check_nan: bool = True) -> None:
        self.check_nan = check_nan
        self._tokens: list[Token[AnomalyMode]] = []

    def _mode(self) -> AnomalyMode:
        return AnomalyMode(True, self.check_nan)

    def __enter__(self) -> None:
        self._tokens.append(_anomaly.set(self._mode()))

    def __exit__(self, *exc: object) -> None:
        _anomaly.reset(self._tokens.pop())

    def __call__(self, func: F) -> F:
        mode = self._mode()
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                token = _anomaly.set(mode)
                try:
                    return await func(*args, **kwargs)
                finally:
                    _anomaly.reset(token)

            return cast(F, async_wrapper)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            token = _anomaly.set(mode)
            try:
                return func(*args, **kwargs)
            finally:
                _anomaly.reset(token)

        return cast(F, wrapper)


class set_detect_anomaly(detect_anomaly):
    """Set anomaly mode to ``mode`` for the enclosed code (context manager or decorator)."""

    def __init__(self, mode: bool, check_nan: bool = True) -> None:
        super().__init__(check_nan)
        self.mode = mode

    def _mode(self) -> AnomalyMode:
        return AnomalyMode(self.mode, self.check_nan)
