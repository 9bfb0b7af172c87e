"""The worker's event loop in a thread of its own: many callers at once, and the watchdog that
names a handler blocking it."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tasks_core.worker.loop import LoopWatchdog, WorkerLoop
from tasks_core.worker.runtime import HANDLER_TASK_PREFIX
from tests.conftest import make_settings


@pytest.fixture
def worker_loop(clean_db: None) -> Any:
    loop = WorkerLoop(make_settings(), worker_name="test@host:1", dense=True, concurrency=50)
    yield loop
    loop.close()


def test_many_threads_run_their_coroutines_on_the_one_loop(worker_loop: WorkerLoop) -> None:
    async def where(n: int) -> tuple[int, str]:
        await asyncio.sleep(0.05)
        return n, threading.current_thread().name

    with ThreadPoolExecutor(50) as pool:
        results = list(pool.map(lambda n: worker_loop.run(where(n)), range(50)))
    assert sorted(n for n, _ in results) == list(range(50))
    assert {name for _, name in results} == {"dtask-loop"}


def test_the_loop_serves_the_database_from_any_caller(worker_loop: WorkerLoop) -> None:
    async def count() -> int:
        return len((await worker_loop.services.repo.list(limit=5))[0])

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(lambda _: worker_loop.run(count()), range(16))) == [0] * 16


def test_worker_sessions_plan_as_the_setting_says(worker_loop: WorkerLoop) -> None:
    """Generic plans by default (the hot statements are not re-planned at every execution)."""
    from sqlalchemy import text

    async def mode() -> str:
        async with worker_loop.services.engine.connect() as conn:
            return str((await conn.execute(text("SHOW plan_cache_mode"))).scalar_one())

    assert worker_loop.run(mode()) == "force_generic_plan"


def test_the_watchdog_names_the_handler_that_blocks_the_loop(caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    watchdog = LoopWatchdog(loop, threshold=0.3, interval=0.05)

    async def blocking() -> None:
        time.sleep(0.8)  # noqa: ASYNC251  (what a badly written handler does)

    async def start() -> None:
        await asyncio.create_task(blocking(), name=f"{HANDLER_TASK_PREFIX}test.blocker:1234")

    try:
        with caplog.at_level(logging.WARNING, logger="tasks_core.worker.loop"):
            asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=5)
            time.sleep(0.3)
        messages = [r.getMessage() for r in caplog.records]
        assert any("blocked" in m and "the handler of test.blocker (task 1234)" in m for m in messages), (
            messages
        )
        assert any("turning again" in m for m in messages), messages
    finally:
        watchdog.stop()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_metrics_reach_redis_while_one_run_keeps_the_process_busy(worker_loop: WorkerLoop) -> None:
    """A process running task after task for one message (DTASK_WORKER_RUN_NEXT) never returns to
    ``run``'s flush: its counters still reach the shared hash, on a timer."""
    from tasks_core import metrics

    counter = metrics.Counter("dtask_test_timer_flush", "test")

    async def long_run() -> bool:
        counter.inc()
        redis = worker_loop.services.redis
        deadline = time.monotonic() + 5 * max(worker_loop.services.settings.metrics_flush_seconds, 0.5)
        while time.monotonic() < deadline:
            if await redis.hget(metrics.METRICS_KEY, "dtask_test_timer_flush|") is not None:
                return True
            await asyncio.sleep(0.05)
        return False

    assert worker_loop.run(long_run())
