"""Grad mode, held in a ``ContextVar`` so two asyncio tasks never see each other's mode.

Each class works as a context manager and as a decorator of plain, ``async`` and generator
functions: the mode is set for the duration of the call, inside the caller's task; a
decorated generator runs each of its steps in the mode and gives the caller's mode back at
every ``yield`` (PyTorch's ``_wrap_generator``). ``no_grad`` and ``enable_grad`` also
decorate without parentheses (``@enable_grad``).

Where PyTorch's grad mode is per thread, ours is per ``contextvars`` context: each asyncio
task runs in its own copy, and code outside any task shares its thread's context. So
``set_grad_enabled(False)`` as a plain call (no ``with``) sets the mode for the rest of the
current task, or for the thread outside any task, as PyTorch's plain call does for the
thread.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import AsyncGenerator, Callable, Generator
from contextvars import ContextVar, Token
from typing import Any, Self, TypeVar, cast, overload

_grad_enabled: ContextVar[bool] = ContextVar("grad_enabled", default=True)
# Bound once for the per-op and per-node paths: ``_grad_enabled.get()`` on the imported name
# compiles to an attribute load that builds a bound method per call (CPython 3.11 treats
# imported names as modules), about 13 ns; calling these does not.
_grad_enabled_get = _grad_enabled.get
_grad_enabled_set = _grad_enabled.set
_grad_enabled_reset = _grad_enabled.reset

F = TypeVar("F", bound=Callable[..., Any])


def is_grad_enabled() -> bool:
    """Whether operations record a graph in the current context."""
    return _grad_enabled.get()


class _ModeContext:
    """Base of the grad-mode context managers: sets a ContextVar and restores it."""

    _var: ContextVar[bool] = _grad_enabled
    _value: bool
    # (set where each instance is made: no Python ``__init__`` call per ``with no_grad():``)
    _tokens: list[Token[bool]]

    def __enter__(self) -> None:
        self._tokens.append(self._var.set(self._value))

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
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

            return cast(F, async_wrapper)

        if inspect.isasyncgenfunction(func):

            @functools.wraps(func)
            def async_generator_wrapper(*args: Any, **kwargs: Any) -> Any:
                return _in_mode_async(self, func(*args, **kwargs))

            return cast(F, async_generator_wrapper)

        if inspect.isgeneratorfunction(func):

            @functools.wraps(func)
            def generator_wrapper(*args: Any, **kwargs: Any) -> Any:
                return (yield from _in_mode(self, func(*args, **kwargs)))

            return cast(F, generator_wrapper)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self._fresh():
                return func(*args, **kwargs)

        return cast(F, wrapper)


def _in_mode(mode: _ModeContext, generator: Generator[Any, Any, Any]) -> Generator[Any, Any, Any]:
    """Drive ``generator`` with each step (start, ``send``, ``throw``, ``close``) run in
    ``mode``, and the caller's mode between steps."""
    try:
        with mode._fresh():
            response = generator.send(None)
        while True:
            try:
                request = yield response
            except GeneratorExit:
                with mode._fresh():
                    generator.close()
                raise
            except BaseException as error:
                with mode._fresh():
                    response = generator.throw(error)
            else:
                with mode._fresh():
                    response = generator.send(request)
    except StopIteration as stop:
        return stop.value


async def _in_mode_async(
    mode: _ModeContext, generator: AsyncGenerator[Any, Any]
) -> AsyncGenerator[Any, Any]:
    """``_in_mode`` for an async generator: each ``asend``/``athrow``/``aclose`` in ``mode``."""
    try:
        with mode._fresh():
            response = await generator.asend(None)
        while True:
            try:
                request = yield response
            except GeneratorExit:
                with mode._fresh():
                    await generator.aclose()
                raise
            except BaseException as error:
                with mode._fresh():
                    response = await generator.athrow(error)
            else:
                with mode._fresh():
                    response = await generator.asend(request)
    except StopAsyncIteration:
        return


class _BareDecorator(_ModeContext):
    """A mode that also decorates without parentheses: ``@no_grad`` as ``@no_grad()``."""

    @overload
    def __new__(cls, func: None = None) -> Self: ...

    @overload
    def __new__(cls, func: F) -> F: ...  # type: ignore[misc]  # @no_grad without parentheses

    def __new__(cls, func: Callable[..., Any] | None = None) -> Any:
        instance = object.__new__(cls)
        instance._tokens = []
        if func is None:
            return instance
        if not callable(func):
            raise TypeError(f"{cls.__name__}() takes no arguments other than a function")
        return instance(func)


class no_grad(_BareDecorator):
    """Disable graph recording. Example::

    with no_grad():
        y = x * 2          # y.requires_grad is False

    @no_grad                # or @no_grad()
    async def evaluate(model, x): ...
    """

    _value = False


class enable_grad(_BareDecorator):
    """Enable graph recording (inside a ``no_grad`` region, for instance); ``@enable_grad``
    and ``@enable_grad()`` decorate."""

    _value = True


class set_grad_enabled(_ModeContext):
    """Set grad mode to ``mode``, as PyTorch's ``set_grad_enabled``.

    As a plain call it sets the mode for the current context (the current task, or the
    thread outside any task), until changed again; as ``with set_grad_enabled(mode):`` it
    restores the previous mode at the end of the block; as a decorator it sets ``mode`` for
    each call and leaves the mode at decoration time unchanged.
    """

    def __init__(self, mode: bool) -> None:
        self._tokens = []
        self._value = bool(mode)
        self._previous = _grad_enabled.get()
        _grad_enabled.set(self._value)

    def __enter__(self) -> None:
        pass  # __init__ (the plain call) has set the mode

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        self._var.set(self._previous)

    def __call__(self, func: F) -> F:
        _grad_enabled.set(self._previous)  # decorating must not change the mode
        return super().__call__(func)

    def _fresh(self) -> _ModeContext:
        return _ScopedMode(self._value)


class _ScopedMode(_ModeContext):
    """``mode`` for one ``with`` block, with no effect before it (what decorators enter)."""

    def __init__(self, value: bool) -> None:
        self._tokens = []
        self._value = value


class inference_mode(no_grad):
    """Like ``no_grad`` (aioautograd has no separate inference tensors); ``inference_mode(False)``
    enables grad."""

    def __new__(cls, mode: Any = True) -> Any:
        if callable(mode):
            instance = super().__new__(cls)
            return instance(mode)
        return super().__new__(cls)

    def __init__(self, mode: Any = True) -> None:
        super().__init__()
        self._value = not mode

    def _fresh(self) -> _ModeContext:
        return _ScopedMode(self._value)
