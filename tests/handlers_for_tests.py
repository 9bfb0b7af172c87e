"""Task types used only by the runtime's tests (registered through a test Registry)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tasks_core.registry import TaskSpec
from tasks_core.worker.context import TaskContext

# Filled by handlers so a test can see what ran, in this process.
EVENTS: list[tuple[str, Any]] = []


async def record_cleanup(ctx: TaskContext) -> Any:
    """Sleeps until cancelled; its finally block is the 'cleanup' a cancelled handler must run."""
    try:
        await asyncio.sleep(float(ctx.payload.get("seconds", 60)))
        return {"finished": True}
    finally:
        EVENTS.append(("cleanup", ctx.task_id))


# Set by a test to let swallow_cancel (and whatever still runs of it) finish.
RELEASE: list[bool] = []


async def swallow_cancel(ctx: TaskContext) -> Any:
    """A badly written handler: it catches its own cancellation and carries on."""
    while not RELEASE:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            EVENTS.append(("swallowed", ctx.task_id))
    return {"released": True}


async def slow_cleanup(ctx: TaskContext) -> Any:
    """Runs until cancelled, then cleans up for longer than a lease (``cleanup`` seconds)."""
    try:
        await asyncio.sleep(3600)
    finally:
        await asyncio.sleep(float(ctx.payload.get("cleanup", 1)))
        EVENTS.append(("cleaned", ctx.task_id))


async def block_loop(ctx: TaskContext) -> Any:
    """A badly written handler: a blocking call on the event loop (no asyncio.to_thread)."""
    time.sleep(float(ctx.payload.get("seconds", 2)))  # noqa: ASYNC251  (the point of it)
    return {"blocked": True}


async def broken_hook(conn: Any, task: Any, status: str) -> None:
    raise RuntimeError("hook exploded on purpose (host db-internal-7:5432)")


async def unserializable(ctx: TaskContext) -> Any:
    return {"not json": object()}


TEST_SPECS = (
    TaskSpec("test.cleanup", "tests.handlers_for_tests:record_cleanup",
             on_failure="domains.diagnostics.hooks:on_failure"),
    TaskSpec("test.retry_safe", "tests.handlers_for_tests:record_cleanup", retry_safe=True, max_attempts=3),
    TaskSpec("test.unserializable", "tests.handlers_for_tests:unserializable"),
    TaskSpec("test.swallow_cancel", "tests.handlers_for_tests:swallow_cancel",
             on_failure="domains.diagnostics.hooks:on_failure"),
    TaskSpec("test.slow_cleanup", "tests.handlers_for_tests:slow_cleanup"),
    TaskSpec("test.broken_success_hook", "domains.diagnostics.handlers:noop",
             on_success="tests.handlers_for_tests:broken_hook"),
)


async def rate_limited(ctx: TaskContext) -> Any:
    """A transient failure that says how long to wait (as a 429's Retry-After would)."""
    from tasks_core.retry import RetryableError

    raise RetryableError("429 Too Many Requests", code="rate_limited", delay=float(ctx.payload["delay"]))
