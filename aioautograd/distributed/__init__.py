"""Distributed aioautograd: the RPC layer (:mod:`.rpc`) and, on top of it, distributed autograd.

Start a multi-process world with ``python -m aioautograd.distributed.run --nproc N script.py``.
"""

from __future__ import annotations

from aioautograd.distributed import rpc

__all__ = ["rpc"]
