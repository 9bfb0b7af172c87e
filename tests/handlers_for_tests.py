"""Task types used only by the runtime's tests (registered through a test Registry)."""

from __future__ import annotations

import asyncio
from typing import Any

from tasks_core.context import TaskContext
from tasks_core.registry import TaskSpec

# Filled by handlers so a test can see what ran, in this process.
EVENTS: list[tuple[str, Any]] = []


async def record_cleanup(ctx: TaskContext) -> Any:
    """Sleeps until cancelled; its finally block is the 'cleanup' a cancelled handler must run."""
    try:
        await asyncio.sleep(float(ctx.payload.get("seconds", 60)))
        return {"finished": True}
    finally:
        EVENTS.append(("cleanup", ctx.task_id))


async def unserializable(ctx: TaskContext) -> Any:
    return {"not json": object()}


TEST_SPECS = (
    TaskSpec("test.cleanup", "tests.handlers_for_tests:record_cleanup",
             on_failure="domains.diagnostics.hooks:on_failure"),
    TaskSpec("test.retry_safe", "tests.handlers_for_tests:record_cleanup", retry_safe=True, max_attempts=3),
    TaskSpec("test.unserializable", "tests.handlers_for_tests:unserializable"),
)
