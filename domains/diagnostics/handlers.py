"""diagnostics.noop / sleep / fail: operators' smoke tests and the runtime's test subjects."""

from __future__ import annotations

import asyncio
from typing import Any

from sqlalchemy.dialects.postgresql import insert

from domains.diagnostics.model import diagnostics_effects, diagnostics_runs
from domains.diagnostics.payloads import FailPayload, SleepPayload
from tasks_core.context import TaskContext


async def noop(ctx: TaskContext) -> Any:
    return ctx.payload


async def sleep(ctx: TaskContext) -> Any:
    """Sleep ``seconds`` in ``steps`` steps, reporting progress each step and honouring cancel.

    With ``"effects": true`` each step also writes a side-effect row stamped with the attempt
    token inside an owning transaction (the fault campaign counts them).
    """
    args = SleepPayload.model_validate(ctx.payload)  # checked at submit; typed here
    seconds, steps, effects = args.seconds, args.steps, args.effects
    async with ctx.owning_transaction() as conn:
        stmt = insert(diagnostics_runs).values(
            task_id=ctx.task_id, attempt_token=ctx.attempt_token, status="running", steps_done=0
        )
        await conn.execute(
            stmt.on_conflict_do_update(
                index_elements=[diagnostics_runs.c.task_id],
                set_={"attempt_token": ctx.attempt_token, "status": "running"},
            )
        )
    for step in range(1, steps + 1):
        await asyncio.sleep(seconds / steps)
        ctx.raise_if_cancelled()
        if effects:
            async with ctx.owning_transaction() as conn:
                await conn.execute(
                    diagnostics_effects.insert().values(
                        task_id=ctx.task_id, attempt_token=ctx.attempt_token, step=step
                    )
                )
                await conn.execute(
                    diagnostics_runs.update()
                    .where(diagnostics_runs.c.task_id == ctx.task_id)
                    .values(steps_done=step)
                )
        await ctx.report(100.0 * step / steps, f"step {step} of {steps}")
    return {"slept": seconds, "steps": steps}


async def fail(ctx: TaskContext) -> Any:
    raise RuntimeError(FailPayload.model_validate(ctx.payload).message)
