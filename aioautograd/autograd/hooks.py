"""Hook handles (PyTorch's ``RemovableHandle``)."""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

_next_id = itertools.count()
# Serialises every registration and removal with its owner's flag update (``Node._plain``):
# a removal's recount and a registration on another thread must not interleave, or the
# flag would say "no hooks" beside a hook. Registration and removal only: never per node.
flag_lock = threading.Lock()


class RemovableHandle:
    """Returned by every ``register_*hook``; ``remove()`` unregisters the hook.

    Also a context manager: the hook is removed on exit.
    """

    __slots__ = ("_hooks_ref", "id")

    def __init__(self, hooks: HookDict, hook: Any) -> None:
        self.id = next(_next_id)
        with flag_lock:
            owner = hooks.owner() if hooks.owner is not None else None
            if owner is not None:
                owner._clear_plain()  # before the hook is in: a node running now skips it
            hooks[self.id] = hook
        self._hooks_ref = weakref.ref(hooks)

    def remove(self) -> None:
        hooks = self._hooks_ref()
        if hooks is not None:
            with flag_lock:
                hooks.pop(self.id, None)
                owner = hooks.owner() if hooks.owner is not None else None
                if owner is not None:
                    owner._refresh_plain()  # the engine's fast path again, if no hook is left

    def __enter__(self) -> RemovableHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class HookDict(dict[int, Any]):
    """An ordered hook container that handles can reference weakly (plain dicts cannot).

    ``owner`` (held weakly: a node's hook dicts must not keep the graph alive): the node or
    tensor whose hooks these are, told by ``RemovableHandle`` when a hook comes
    (``_clear_plain``) and goes (``_refresh_plain``), so that a node whose last hook goes
    takes the engine's fast path again.
    """

    __slots__ = ("__weakref__", "owner")

    def __init__(self, owner: Any = None) -> None:
        super().__init__()
        self.owner: weakref.ReferenceType[Any] | None = (
            None if owner is None else weakref.ref(owner)
        )
