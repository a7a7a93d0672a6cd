"""The exceptions of the RPC layer, and the rebuilding of exceptions raised on other workers.

An exception raised by a remote function travels as data (its type name, message, worker name
and formatted traceback), never as a pickled object. The caller raises a :class:`RemoteError`;
when the original type is a built-in exception (``ValueError``, ``KeyError``, ...) or one of the
errors below, the raised object is also an instance of that type, so ``except ValueError``
works across the wire as it does locally.
"""

from __future__ import annotations

import builtins
import functools


class RpcError(RuntimeError):
    """Base class of the errors raised by the RPC layer."""


class RemoteError(RpcError):
    """An exception raised by a function on another worker.

    Attributes:
        type_name: The qualified name of the original exception type (``"ValueError"``,
            ``"mypackage.errors.MyError"``).
        remote_message: The original exception's message (``str(exc)``).
        worker_name: The name of the worker where it was raised (the first one, when it
            travelled through several nested calls).
        remote_traceback: The formatted traceback on that worker (also attached as a note).
    """

    type_name: str
    remote_message: str
    worker_name: str
    remote_traceback: str

    def __str__(self) -> str:
        # Built-ins such as KeyError would show the repr of the message.
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class RpcTimeoutError(RpcError, TimeoutError):
    """An RPC did not complete within its timeout (the remote work is cancelled)."""


class WorkerUnavailableError(RpcError, ConnectionError):
    """The destination worker is unknown, unreachable, shut down or marked dead."""


class RpcAuthenticationError(RpcError, PermissionError):
    """A peer refused this worker (wrong or missing token) or a TLS handshake failed."""


class RpcLimitError(RpcError):
    """A message or the load exceeded a configured bound (message size, calls in flight).

    The message names the bound and the option that raises it; the worker keeps serving.
    """


class FunctionNotRegisteredError(RpcError, LookupError):
    """The callee refused to run a function that is neither registered nor allow-listed."""


class MalformedMessageError(RpcError, ValueError):
    """Bytes that are not a well-formed RPC message (truncated, corrupt or hostile)."""


_RPC_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        RpcError,
        RpcTimeoutError,
        WorkerUnavailableError,
        RpcAuthenticationError,
        FunctionNotRegisteredError,
        MalformedMessageError,
    )
}


def type_name_of(exc: BaseException) -> str:
    """The name sent for ``exc``'s type: bare for built-ins and our errors, else qualified."""
    if isinstance(exc, RemoteError):
        return exc.type_name
    cls = type(exc)
    if cls.__module__ == "builtins" or _RPC_ERRORS.get(cls.__name__) is cls:
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


@functools.cache
def _remote_class(type_name: str) -> type[RemoteError]:
    local: object = _RPC_ERRORS.get(type_name) or getattr(builtins, type_name, None)
    if (
        isinstance(local, type)
        and issubclass(local, Exception)
        and not issubclass(local, StopIteration | StopAsyncIteration)
        and local is not RemoteError
    ):
        try:
            return type(type_name, (RemoteError, local), {"__module__": __name__})
        except TypeError:  # an incompatible instance layout
            pass
    return RemoteError


def rebuild_remote_error(
    type_name: str, message: str, worker_name: str, traceback: str
) -> RemoteError:
    """The exception the caller raises for an error reported by ``worker_name``."""
    cls = _remote_class(type_name)
    try:
        exc = cls(f"[worker {worker_name!r}] {type_name}: {message}")
    except TypeError:  # a built-in whose constructor wants more than a message
        exc = RemoteError(f"[worker {worker_name!r}] {type_name}: {message}")
    exc.type_name = type_name
    exc.remote_message = message
    exc.worker_name = worker_name
    exc.remote_traceback = traceback
    if traceback:
        exc.add_note(f"Remote traceback (on worker {worker_name!r}):\n{traceback.rstrip()}")
    return exc
