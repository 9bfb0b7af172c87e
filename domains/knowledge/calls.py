"""Blocking store clients (pymilvus, minio) called from async code, each store in its own threads.

Every call runs in its store's own small thread pool, never the event loop's default executor: a
stalled Milvus then ties up Milvus' threads only, while S3 calls, embedding and the handlers'
other ``asyncio.to_thread`` work (and in the api every other route) go on. The client library
enforces each request's deadline itself (pymilvus' ``timeout``, urllib3's connect and read
timeouts), so a call that runs is bounded, however long a large transfer that keeps moving takes;
a call that cannot even get a thread within its deadline (every thread waits on a stalled server)
fails at once as unavailable instead of queueing behind them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from domains.knowledge.cache import PerProcess
from domains.knowledge.errors import StoreUnavailable

T = TypeVar("T")
# Threads per store and process: a stall can hold this many; more calls than that wait their turn.
THREADS = 8

_pools: PerProcess[str, ThreadPoolExecutor] = PerProcess()


def _pool(service: str) -> ThreadPoolExecutor:
    """The service's threads in this process."""
    return _pools.get(service, lambda: ThreadPoolExecutor(THREADS, thread_name_prefix=f"store-{service}"))


async def blocking(service: str, deadline: float, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in ``service``'s threads; StoreUnavailable if no thread takes it
    within ``deadline`` seconds. ``fn`` must bound its own requests (the clients' timeouts).

    A call given up on may still complete on the server later (a put after a pause ends): writes
    are keyed, so a late one is overwritten or cleaned up, never counted twice."""
    loop = asyncio.get_running_loop()
    started = loop.create_future()

    def run() -> T:
        loop.call_soon_threadsafe(_resolve, started)
        return fn(*args, **kwargs)

    future = loop.run_in_executor(_pool(service), run)
    try:
        await asyncio.wait_for(asyncio.shield(started), deadline)
    except TimeoutError:
        future.cancel()  # still queued: it never runs
        detail = f"its {THREADS} calls in flight here have not answered; this one waited {deadline:g} s"
        raise StoreUnavailable(service, detail) from None
    return await future


def _resolve(started: asyncio.Future[None]) -> None:
    if not started.done():
        started.set_result(None)
