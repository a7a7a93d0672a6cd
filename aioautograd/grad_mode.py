"""Grad mode, held in a ``ContextVar`` so two asyncio tasks never see each other's mode.

Each class works as a context manager and as a decorator of plain and ``async``
functions (the mode is set for the duration of the call, inside the caller's task).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from contextvars import ContextVar, Token
from typing import Any, TypeVar

_grad_enabled: ContextVar[bool] = ContextVar("grad_enabled", default=True)

F = TypeVar("F", bound=Callable[..., Any])


def is_grad_enabled() -> bool:
    """Whether operations record a graph in the current context."""
    return _grad_enabled.get()


class _ModeContext:
    """Base of the grad-mode context managers: sets a ContextVar and restores it."""

    _var: ContextVar[bool] = _grad_enabled
    _value: bool

    def __init__(self) -> None:
        self._tokens: list[Token[bool]] = []

    def __enter__(self) -> None:
        self._tokens.append(self._var.set(self._value))

    def __exit__(self, *exc: object) -> None:
        self._var.reset(self._tokens.pop())

    def _fresh(self) -> _ModeContext:
        return type(self)()

    def __call__(self, func: F) -> F:
        if inspect.isclass(func):
            warnings.warn(
                "Decorating classes is deprecated and will be disabled in future versions. "
                "You should only decorate functions or methods. To preserve the current "
                "behavior of class decoration, you can directly decorate the `__init__` "
                "method and nothing else.",
                FutureWarning,
                stacklevel=2,
            )
            # As PyTorch: calling the decorated class constructs an instance in the mode.
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                with self._fresh():
                    return await func(*args, **kwargs)

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self._fresh():
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


class no_grad(_ModeContext):
    """Disable graph recording. Example::

    with no_grad():
        y = x * 2          # y.requires_grad is False

    @no_grad()
    async def evaluate(model, x): ...
    """

    _value = False


class enable_grad(_ModeContext):
    """Enable graph recording (inside a ``no_grad`` region, for instance)."""

    _value = True


class set_grad_enabled(_ModeContext):
    """Set grad mode to ``mode``. Unlike PyTorch, calling it without ``with`` does not leak the
    mode out of the statement; use ``with set_grad_enabled(mode):`` or the decorator form."""

    def __init__(self, mode: bool) -> None:
        super().__init__()
        self._value = bool(mode)

    def _fresh(self) -> _ModeContext:
        return set_grad_enabled(self._value)


class inference_mode(no_grad):
    """Like ``no_grad`` (aioautograd has no separate inference tensors)."""

    def __init__(self, mode: bool = True) -> None:
        super().__init__()
        self._value = not mode

    def _fresh(self) -> _ModeContext:
        return inference_mode(not self._value)
