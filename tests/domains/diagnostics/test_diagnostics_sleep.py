"""diagnostics.sleep rides out a database blink inside its owning transactions (the fault campaign
holds it to this too: a blink delays a task, never ends it): a write cut off by a transient error
is re-run, and a re-run never stores a step twice."""

from __future__ import annotations

from typing import Any

from repo_helpers import claim, submit
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from domains.diagnostics import handlers
from tasks_core.worker.context import TaskContext
from tasks_core.worker.lease import LeaseClock


async def context(services: Any) -> TaskContext:
    payload = {"seconds": 0.0, "steps": 3, "effects": True}
    task_id = await submit(services.repo, "diagnostics.sleep", payload)
    got = await claim(services.repo, services.registry, task_id)
    return TaskContext(services.repo, got.task, got.token, got.attempt, lease=LeaseClock(30.0))


async def effect_steps(services: Any, ctx: TaskContext) -> list[int]:
    async with services.engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT step FROM diagnostics_effects WHERE attempt_token = :tok ORDER BY step"),
            {"tok": ctx.attempt_token},
        )
        return [r[0] for r in rows]


async def test_a_step_written_twice_by_one_attempt_is_stored_once(services: Any) -> None:
    ctx = await context(services)
    for _ in range(2):  # a re-run after a COMMIT whose answer was lost
        async with ctx.owning_transaction() as conn:
            await handlers._write_effect(ctx, 1, conn)
    assert await effect_steps(services, ctx) == [1]


async def test_a_write_cut_off_by_a_transient_error_is_run_again(services: Any) -> None:
    ctx = await context(services)
    calls = 0

    async def cut_off_once(conn: AsyncConnection) -> None:
        nonlocal calls
        calls += 1
        await handlers._write_effect(ctx, 1, conn)
        if calls == 1:
            raise ConnectionResetError("the server went away mid-transaction")  # rolled back

    await ctx.run_in_owning_transaction(cut_off_once)
    assert calls == 2
    assert await effect_steps(services, ctx) == [1]


async def test_the_sleep_handler_writes_one_effect_per_step(services: Any) -> None:
    ctx = await context(services)
    assert await handlers.sleep(ctx) == {"slept": 0.0, "steps": 3}
    assert await effect_steps(services, ctx) == [1, 2, 3]
