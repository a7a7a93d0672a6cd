"""Which functions a worker agrees to run for its peers.

A remote call names its function by a string. The callee runs it only if the name is in the
process-wide registry (filled by :func:`register`) or on the allow-list the callee's
``init_rpc(allowed_functions=...)`` received (``"module:qualname"`` entries, imported at
init). Any other name is refused with :class:`FunctionNotRegisteredError` before its
arguments are even decoded: nothing is imported or executed on a peer's say-so.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, overload

from aioautograd.distributed.rpc.errors import FunctionNotRegisteredError

F = TypeVar("F", bound=Callable[..., Any])

INTERNAL_PREFIX = "__rpc__:"

_by_name: dict[str, Callable[..., Any]] = {}
_by_function: dict[Callable[..., Any], str] = {}
_lock = threading.Lock()


def default_name(fn: Callable[..., Any]) -> str:
    """``module:qualname`` of ``fn``, the name it is registered and called under by default."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        raise ValueError(
            f"{fn!r} has no importable name (lambdas and nested functions have none): "
            "define it at module level, or register it with an explicit name"
        )
    return f"{module}:{qualname}"


@overload
def register(fn: F, /) -> F: ...
@overload
def register(*, name: str | None = None) -> Callable[[F], F]: ...
def register(fn: F | None = None, /, *, name: str | None = None) -> F | Callable[[F], F]:
    """Register ``fn`` so that peers may call it by name (a decorator).

    The name defaults to ``"module:qualname"``; every process of a world must register the
    function under the same name (importing the same module does that). ``rpc_async`` takes
    the function object or the name. Plain functions run on the callee's worker threads;
    ``async def`` functions run on its event loop.

    Example::

        @rpc.register
        async def add(x: Tensor, y: Tensor) -> Tensor:
            return x + y

        await rpc.rpc_async("worker1", add, args=(a, b))

    Raises:
        ValueError: when the name is taken by another function, or is reserved.
    """

    def decorate(function: F) -> F:
        key = name if name is not None else default_name(function)
        if not key or key.startswith(INTERNAL_PREFIX):
            raise ValueError(f"invalid RPC function name {key!r}")
        with _lock:
            existing = _by_name.get(key)
            if existing is not None and existing is not function:
                if default_name(existing) != default_name(function):
                    raise ValueError(f"RPC function name {key!r} is already registered")
                # The same definition executed again (a module reloaded): the newest wins.
                _by_function.pop(existing, None)
            _by_name[key] = function
            _by_function[function] = key
        return function

    return decorate if fn is None else decorate(fn)


def unregister(fn_or_name: Callable[..., Any] | str) -> None:
    """Remove a registration (for tests and notebooks that redefine functions)."""
    with _lock:
        if isinstance(fn_or_name, str):
            fn = _by_name.pop(fn_or_name, None)
            if fn is not None:
                _by_function.pop(fn, None)
        else:
            key = _by_function.pop(fn_or_name, None)
            if key is not None:
                _by_name.pop(key, None)


def name_of(fn: Callable[..., Any] | str) -> str:
    """The wire name for ``fn``: its registered name, or ``module:qualname``."""
    if isinstance(fn, str):
        if not fn:
            raise ValueError("empty RPC function name")
        return fn
    registered = _by_function.get(fn)
    return registered if registered is not None else default_name(fn)


def _import_entry(entry: str) -> Callable[..., Any]:
    module_name, sep, qualname = entry.partition(":")
    if not sep or not module_name or not qualname:
        raise ValueError(f"allow-list entries are 'module:qualname', got {entry!r}")
    target: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"allow-list entry {entry!r} is not callable")
    function: Callable[..., Any] = target
    return function


class FunctionPolicy:
    """A callee's view: the registry plus its own allow-list (imported once, at init)."""

    def __init__(self, allowed_functions: Iterable[str] = ()) -> None:
        self._allowed = {entry: _import_entry(entry) for entry in allowed_functions}

    def resolve(self, name: str, worker_name: str) -> Callable[..., Any]:
        """The function to run for ``name``.

        Raises:
            FunctionNotRegisteredError: when ``name`` is neither registered nor allowed.
        """
        fn = self._allowed.get(name) or _by_name.get(name)
        if fn is None:
            raise FunctionNotRegisteredError(
                f"function {name!r} is not registered on worker {worker_name!r}: decorate it "
                "with @rpc.register in a module every worker imports, or add "
                "'module:qualname' to init_rpc(allowed_functions=...) on the callee"
            )
        return fn
