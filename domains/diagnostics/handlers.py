"""diagnostics.noop / sleep / fail / flaky: operators' smoke tests and the runtime's test subjects."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

from sqlalchemy import exists, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from domains.diagnostics.model import diagnostics_effects, diagnostics_runs
from domains.diagnostics.payloads import FailPayload, FlakyPayload, SleepPayload
from tasks_core.retry import RetryableError
from tasks_core.worker.context import TaskContext


async def noop(ctx: TaskContext) -> Any:
    return ctx.payload


async def sleep(ctx: TaskContext) -> Any:
    """Sleep ``seconds`` in ``steps`` steps, reporting progress each step and honouring cancel.

    With ``"effects": true`` each step also writes a side-effect row stamped with the attempt
    token inside an owning transaction (the fault campaign counts them). Its owning transactions
    are the retrying kind: a database blink re-runs them while the lease may hold, so a restart
    shorter than the lease delays the task instead of failing it; both writes are idempotent.
    """
    args = SleepPayload.model_validate(ctx.payload)  # checked at submit; typed here
    seconds, steps, effects = args.seconds, args.steps, args.effects
    await ctx.run_in_owning_transaction(partial(_mark_running, ctx))
    for step in range(1, steps + 1):
        await asyncio.sleep(seconds / steps)
        ctx.raise_if_cancelled()
        if effects:
            await ctx.run_in_owning_transaction(partial(_write_effect, ctx, step))
        await ctx.report(100.0 * step / steps, f"step {step} of {steps}")
    return {"slept": seconds, "steps": steps}


async def _mark_running(ctx: TaskContext, conn: AsyncConnection) -> None:
    stmt = insert(diagnostics_runs).values(
        task_id=ctx.task_id, attempt_token=ctx.attempt_token, status="running", steps_done=0
    )
    await conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[diagnostics_runs.c.task_id],
            set_={"attempt_token": ctx.attempt_token, "status": "running"},
        )
    )


async def _write_effect(ctx: TaskContext, step: int, conn: AsyncConnection) -> None:
    # A re-run after a COMMIT whose answer was lost finds its row and writes no second one (the
    # owning transaction holds the task row's lock, so nobody else writes meanwhile).
    mine = {"task_id": ctx.task_id, "attempt_token": ctx.attempt_token, "step": step}
    effects = diagnostics_effects.c
    written = await conn.scalar(select(exists().where(*(effects[k] == v for k, v in mine.items()))))
    if not written:
        await conn.execute(diagnostics_effects.insert().values(**mine))
    await conn.execute(
        diagnostics_runs.update().where(diagnostics_runs.c.task_id == ctx.task_id).values(steps_done=step)
    )


async def fail(ctx: TaskContext) -> Any:
    raise RuntimeError(FailPayload.model_validate(ctx.payload).message)


async def flaky(ctx: TaskContext) -> Any:
    """A transient failure on each of the first ``fail_times`` attempts, then success."""
    fail_times = FlakyPayload.model_validate(ctx.payload).fail_times
    if ctx.attempt <= fail_times:
        raise RetryableError(f"attempt {ctx.attempt} fails on purpose", code="flaky")
    return {"attempt": ctx.attempt}
