"""Distributed aioautograd: the RPC layer (:mod:`.rpc`) and, on top of it, distributed autograd
(:mod:`.autograd`) and the distributed optimizer (:mod:`.optim`).

Start a multi-process world with ``python -m aioautograd.distributed.run --nproc N script.py``.
Needs the ``distributed`` extra (``pip install 'aioautograd[distributed]'``: msgpack, and
grpcio for the ``grpc`` backend). Importing this package installs distributed autograd on
every RPC agent started afterwards.
"""

from __future__ import annotations

try:
    import msgpack  # type: ignore[import-untyped]  # noqa: F401
except ImportError as exc:
    raise ImportError(
        "aioautograd.distributed needs msgpack (and grpcio for the `grpc` backend), which a "
        "plain install leaves out: pip install 'aioautograd[distributed]'"
    ) from exc

from aioautograd.distributed import autograd, optim, rpc

__all__ = ["autograd", "optim", "rpc"]
