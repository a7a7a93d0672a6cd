"""Distributed aioautograd: the RPC layer (:mod:`.rpc`) and, on top of it, distributed autograd
(:mod:`.autograd`) and the distributed optimizer (:mod:`.optim`).

Start a multi-process world with ``python -m aioautograd.distributed.run --nproc N script.py``.
Importing this package installs distributed autograd on every RPC agent started afterwards.
"""

from __future__ import annotations

from aioautograd.distributed import autograd, optim, rpc

__all__ = ["autograd", "optim", "rpc"]
