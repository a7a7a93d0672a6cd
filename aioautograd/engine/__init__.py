"""The asyncio-native autograd engine (mirrors engine.cpp / graph_task.h)."""

from aioautograd.engine.engine import (
    Engine,
    get_default_engine,
    offload,
    queue_callback,
    set_default_engine,
)
from aioautograd.engine.executor import MAX_DEPTH
from aioautograd.engine.policy import EnginePolicy
from aioautograd.engine.watchdog import BlockedWorkerWarning

__all__ = [
    "MAX_DEPTH",
    "BlockedWorkerWarning",
    "Engine",
    "EnginePolicy",
    "get_default_engine",
    "offload",
    "queue_callback",
    "set_default_engine",
]
