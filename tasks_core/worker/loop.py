"""One asyncio loop per worker process, in a thread of its own.

Every Celery task — from a prefork child's main thread, the solo pool, or any of the many threads
of the dense mode (`--pool threads`) — hands its coroutine to this loop and waits for the result.
So one process runs many durable tasks at once on one loop, one database pool and one Redis client,
and a task's heartbeat always runs beside its handler.

The loop is created after fork, on first use (never at import or in a prefork parent): a pool
reused across loops breaks ("another operation is in progress").

Sharing a loop has one rule: a handler must not block it. The watchdog thread notices a loop that
stops turning and names the handler that holds it (its task type and id), since every neighbour's
heartbeat waits meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from tasks_core import metrics
from tasks_core.services import Services, Transport, build_services
from tasks_core.settings import Settings
from tasks_core.worker.runtime import HANDLER_TASK_PREFIX, ShutdownSignal

log = logging.getLogger(__name__)
T = TypeVar("T")


class WorkerLoop:
    def __init__(
        self,
        settings: Settings,
        *,
        worker_name: str | None,
        dense: bool,
        concurrency: int,
        transport: Transport | None = None,
    ) -> None:
        self.pid = os.getpid()
        self.dense = dense
        self.loop = asyncio.new_event_loop()
        self.shutdown = ShutdownSignal()
        extra = {"worker_name": worker_name} if worker_name else None
        # A prefork child runs one task: its handler's writes, the heartbeat and the relay need a
        # few connections. The dense mode's tasks share one pool, sized well below their number:
        # a worker must never exhaust the server's max_connections; tasks wait for a connection.
        size, overflow = (min(concurrency, 10), 10) if dense else (2, 2)
        self.services: Services = build_services(
            settings, transport, pool_size=size, max_overflow=overflow, extra=extra,
            plan_cache_mode=settings.worker_plan_cache_mode,
        )
        # An unresponsive handler was left running in this loop (it ignored its cancellation).
        self.abandoned = False
        self._flush_task: asyncio.Task[None] | None = None  # the flush under way, if any
        self._thread = threading.Thread(target=self._serve, name="dtask-loop", daemon=True)
        self._thread.start()
        self.watchdog = LoopWatchdog(self.loop, settings.loop_lag_warn_seconds)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._flush_on_timer)
        self.loop.run_forever()

    def _flush_on_timer(self) -> None:
        # Every DTASK_METRICS_FLUSH_SECONDS, from the loop itself: a flush per task would be a Redis
        # round trip per task, and a process running task after task for one message
        # (DTASK_WORKER_RUN_NEXT) may not return from ``run`` for minutes. The last deltas go when
        # the process stops.
        if self._flush_task is None or self._flush_task.done():
            self._flush_task = self.loop.create_task(self._flush())
        self.loop.call_later(max(self.services.settings.metrics_flush_seconds, 0.1), self._flush_on_timer)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for it (from any thread but the loop's own)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _flush(self) -> None:
        try:
            await metrics.flush(self.services.redis)
        except Exception:  # metrics must never fail a task; the deltas wait for the next flush
            log.warning("could not flush metrics to Redis", exc_info=True)

    def request_shutdown(self) -> None:
        """Warm shutdown: every running handler gets the grace period (callable from any thread
        or a signal handler)."""
        self.loop.call_soon_threadsafe(self.shutdown.set)

    def close(self) -> None:
        self.watchdog.stop()
        try:
            future: Future[None] = asyncio.run_coroutine_threadsafe(self._close(), self.loop)
            future.result(timeout=30)
        except Exception:
            log.warning("closing the worker loop's services failed", exc_info=True)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        # A handler that ignored its cancellation is still in the loop: leave the loop unclosed
        # (closing would wait for it) and let the process exit.
        if not self.abandoned and not self._thread.is_alive():
            self.loop.close()

    async def _close(self) -> None:
        await self._flush()
        await self.services.close()


class LoopWatchdog:
    """A thread that asks the loop for a tick every ``interval``; when none comes for ``threshold``
    seconds it logs which handler holds the loop, and how long it held it once it lets go."""

    def __init__(self, loop: asyncio.AbstractEventLoop, threshold: float, interval: float = 0.1) -> None:
        self.loop, self.threshold, self.interval = loop, threshold, interval
        self._ticked = time.monotonic()
        self._stop = threading.Event()
        self.blocked_by: str | None = None
        self._thread = threading.Thread(target=self._watch, name="dtask-loop-watchdog", daemon=True)
        if threshold > 0:
            self._thread.start()

    def _tick(self) -> None:
        self._ticked = time.monotonic()

    def _watch(self) -> None:
        blocked_since: float | None = None
        while not self._stop.wait(self.interval):
            with contextlib.suppress(RuntimeError):  # the loop is closing
                self.loop.call_soon_threadsafe(self._tick)
            stalled = time.monotonic() - self._ticked
            if stalled >= self.threshold and blocked_since is None:
                blocked_since = self._ticked
                self.blocked_by = _running_handler(self.loop)
                log.warning(
                    "event loop blocked for %.1f s by %s: every task of this process waits (heartbeats "
                    "included); run blocking calls with asyncio.to_thread",
                    stalled, self.blocked_by or "a callback that is not a handler",
                )
            elif stalled < self.interval * 2 and blocked_since is not None:
                log.warning(
                    "event loop turning again after %.1f s (blocked by %s)",
                    self._ticked - blocked_since, self.blocked_by or "a callback that is not a handler",
                )
                blocked_since = None

    def stop(self) -> None:
        self._stop.set()


def _running_handler(loop: asyncio.AbstractEventLoop) -> str | None:
    """The handler task the loop is executing right now, as 'type (task id)', read from another
    thread: asyncio keeps the current task of each loop in a plain dict."""
    current = getattr(asyncio.tasks, "_current_tasks", {}).get(loop)
    name = current.get_name() if current is not None else ""
    if not name.startswith(HANDLER_TASK_PREFIX):
        return None
    task_type, _, task_id = name.removeprefix(HANDLER_TASK_PREFIX).rpartition(":")
    return f"the handler of {task_type} (task {task_id})"
