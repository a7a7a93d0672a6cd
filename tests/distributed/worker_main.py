"""A worker process for the grpc tests: ``python -m tests.distributed.worker_main``.

Reads RANK, WORLD_SIZE, MASTER_ADDR/PORT, AIOAUTOGRAD_RPC_TOKEN and the AIOAUTOGRAD_TLS_*
variables like any launched script, plus TEST_WORKER_NAME, TEST_HEARTBEAT
("interval,timeout"), TEST_GRPC_OPTIONS (JSON: more GrpcOptions fields) and
TEST_HOLD_SHUTDOWN (non-empty: shut down only once the driver opens
``semantic_fns.open_shutdown_gate``) and TEST_UVLOOP (non-empty: run on uvloop); serves
until the world shuts down.
"""

from __future__ import annotations

import asyncio
import json
import os

from aioautograd.distributed import rpc
from tests.distributed import (  # noqa: F401 (registers)
    dist_fns,
    hardening_fns,
    remote_fns,
    semantic_fns,
)


async def main() -> None:
    interval, timeout = (float(x) for x in os.environ["TEST_HEARTBEAT"].split(","))
    options = rpc.GrpcOptions(
        heartbeat_interval=interval,
        heartbeat_timeout=timeout,
        init_timeout=30,
        **json.loads(os.environ.get("TEST_GRPC_OPTIONS", "{}")),
    )
    remote_fns.install_test_interceptor()
    await rpc.init_rpc(
        os.environ["TEST_WORKER_NAME"],
        backend="grpc",
        options=options,
        allowed_functions=remote_fns.ALLOWED,
    )
    if os.environ.get("TEST_HOLD_SHUTDOWN"):
        await semantic_fns.wait_for_shutdown_gate(os.environ["TEST_WORKER_NAME"])
    await rpc.shutdown()


if __name__ == "__main__":
    if os.environ.get("TEST_UVLOOP"):
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())
