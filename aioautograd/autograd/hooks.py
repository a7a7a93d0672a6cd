"""Hook handles (PyTorch's ``RemovableHandle``)."""

from __future__ import annotations

import itertools
import weakref
from typing import Any

_next_id = itertools.count()


class RemovableHandle:
    """Returned by every ``register_*hook``; ``remove()`` unregisters the hook.

    Also a context manager: the hook is removed on exit.
    """

    __slots__ = ("_hooks_ref", "id")

    def __init__(self, hooks: HookDict, hook: Any) -> None:
        self.id = next(_next_id)
        hooks[self.id] = hook
        self._hooks_ref = weakref.ref(hooks)

    def remove(self) -> None:
        hooks = self._hooks_ref()
        if hooks is not None:
            hooks.pop(self.id, None)

    def __enter__(self) -> RemovableHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class HookDict(dict[int, Any]):
    """An ordered hook container that handles can reference weakly (plain dicts cannot)."""

    __slots__ = ("__weakref__",)
