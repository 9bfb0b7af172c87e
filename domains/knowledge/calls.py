"""Blocking store clients (pymilvus, minio) called from async code, each store in its own threads.

Every call runs in its store's own small thread pool, never the event loop's default executor: a
stalled Milvus then ties up Milvus' threads only, while S3 calls, embedding and the handlers'
other ``asyncio.to_thread`` work (and in the api every other route) go on. The client library
enforces the call's deadline itself; the wait here is bounded too (the deadline plus a little),
so a call queued behind stalled ones fails in time instead of waiting for a thread.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from domains.knowledge.errors import StoreUnavailable

T = TypeVar("T")
# Threads per store and process: a stall can hold this many; more calls than that wait their turn.
THREADS = 8
# How much longer than the client's own deadline a call may take (thread hand-over, a slow machine).
SLACK_SECONDS = 2.0

_pools: dict[str, ThreadPoolExecutor] = {}
_pid = os.getpid()


def _pool(service: str) -> ThreadPoolExecutor:
    """The service's threads in this process (a forked worker child starts with none)."""
    global _pid
    if _pid != os.getpid():
        _pools.clear()
        _pid = os.getpid()
    pool = _pools.get(service)
    if pool is None:
        pool = _pools[service] = ThreadPoolExecutor(THREADS, thread_name_prefix=f"store-{service}")
    return pool


async def blocking(service: str, deadline: float, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in ``service``'s threads; StoreUnavailable if no answer in time.

    A call that timed out here may still complete on the server later (a put after a pause ends):
    writes are keyed, so a late one is overwritten or cleaned up, never counted twice."""
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(_pool(service), functools.partial(fn, *args, **kwargs))
    try:
        return await asyncio.wait_for(future, deadline + SLACK_SECONDS)
    except TimeoutError:
        raise StoreUnavailable(service, f"no answer within {deadline:g} s") from None
