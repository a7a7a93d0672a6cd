"""The asyncio-native autograd engine (mirrors engine.cpp / graph_task.h)."""

from aioautograd.engine.engine import Engine, get_default_engine, queue_callback
from aioautograd.engine.executor import MAX_DEPTH

__all__ = ["MAX_DEPTH", "Engine", "get_default_engine", "queue_callback"]
