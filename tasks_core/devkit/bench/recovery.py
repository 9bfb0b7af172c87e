"""`dtask bench recovery`: how long tasks of a SIGKILLed worker take to reach a terminal state,
against the promised bound, lease + reconcile interval (invariant I3).

The cluster is beat plus a surviving worker that runs duties; each round starts a victim worker,
runs N long ``diagnostics.sleep`` tasks on it (the survivor consumes the durable queue only once
they run, so they all land on the victim), then kills. Variants, in alternating rounds:

- ``kill-worker``: SIGKILL the victim's whole process group (main process and pool children).
- ``kill-child``: SIGKILL only the pool child running one of the tasks (found through the attempt's
  ``worker`` name, ``node:pid``); Celery replaces the child, the task's message is already gone.

Recovery of a task is ``finished_at`` minus PostgreSQL's clock read just before the kill. The
tight bound for each task is its lease expiry at the kill plus the reconcile interval.
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text

from tasks_core.db import db_now
from tasks_core.devkit.bench.common import (
    BenchEnv,
    BenchError,
    CommonOptions,
    Proc,
    durable_services,
    effective_settings,
    poll,
    public_options,
    reset_tables,
    seconds,
    submit,
    wait_running,
    wait_terminal,
    worker_pids,
)
from tasks_core.devkit.bench.report import Document, Rounds, alternate, ratio, summarize
from tasks_core.duties.readiness import READINESS_KEY
from tasks_core.transport import DURABLE_QUEUE, DUTIES_QUEUE

SLEEP = "diagnostics.sleep"
LONG_SLEEP = {"seconds": 24 * 3600, "steps": 24 * 3600}  # progress every second until killed


@dataclass
class RecoveryOptions(CommonOptions):
    tasks: int = 4
    lease_seconds: float = 30.0
    reconcile_seconds: float = 10.0
    publish_seconds: float = 15.0
    capacity: int = 4
    concurrency: int = 6


QUICK = {"tasks": 2, "lease_seconds": 2.0, "reconcile_seconds": 1.0, "publish_seconds": 2.0, "rounds": 1,
         "capacity": 2, "concurrency": 3}


def run(opts: RecoveryOptions) -> dict[str, Any]:
    if not 1 <= opts.tasks <= min(opts.capacity, opts.concurrency):
        raise ValueError("--tasks must be between 1 and min(--capacity, --concurrency)")
    return asyncio.run(_run(opts))


async def _run(opts: RecoveryOptions) -> dict[str, Any]:
    bound = opts.lease_seconds + opts.reconcile_seconds
    variants = {
        "kill-worker": f"SIGKILL the process group of a worker running {opts.tasks} sleeps",
        "kill-child": "SIGKILL the pool child running one sleep (the main process survives)",
    }
    doc = Document("recovery", {**public_options(opts), "bound_seconds": bound}, quick=opts.quick)
    rounds = Rounds(variants)
    async with BenchEnv("recovery", opts) as env:
        db_url = await env.create_database("recovery")
        services = durable_services(env, db_url, capacity=opts.capacity)
        settings = env.dtask_settings(
            db_url, capacity=opts.capacity, worker_concurrency=opts.concurrency,
            lease_seconds=opts.lease_seconds, reconcile_seconds=opts.reconcile_seconds,
            publish_seconds=opts.publish_seconds,
        )
        doc.settings.update(worker_env=effective_settings(settings), celery=env.celery_settings())
        try:
            beat = env.start_beat(settings)
            # The survivor runs duties only until the victim holds every task (see _round).
            survivor = env.start_worker("survivor", settings, concurrency=opts.concurrency,
                                        queues=(DUTIES_QUEUE,))
            await env.wait_ready(survivor)
            await _wait_readiness(env, beat, survivor, within=3 * opts.reconcile_seconds + 30)
            for round_no, seq, name in alternate(list(variants), opts.rounds):
                data = await _round(env, services, settings, opts, name, survivor, beat)
                rounds.add(name, round_no, seq, {**data, "bound_seconds": bound,
                                                 "max_over_bound": data["max_recovery_seconds"] / bound})
        finally:
            await services.close()
    doc.data["variants"] = rounds.to_json()
    rows = []
    for name in variants:
        m = rounds.medians(name)
        worst = max((r["max_recovery_seconds"] for r in rounds.rounds[name]), default=None)
        doc.data["ratios"][f"{name}: worst recovery / bound"] = ratio(worst, bound)
        rows.append([name, m.get("p50_recovery_seconds"), m.get("max_recovery_seconds"), worst, bound,
                     ratio(worst, bound), len(rounds.rounds[name])])
    doc.table(f"recovery (s): lease {opts.lease_seconds:g} + reconcile {opts.reconcile_seconds:g}",
              ["variant", "median p50", "median max", "worst", "bound", "worst/bound", "rounds"], rows)
    return doc.finish()


async def _wait_readiness(env: BenchEnv, *procs: Proc, within: float) -> None:
    """Beat scheduled a reconcile and a worker ran it: the chain that recovers tasks is up."""
    env.redis.delete(READINESS_KEY)

    async def written() -> bool:
        return bool(env.redis.exists(READINESS_KEY))

    await poll(written, within=within, interval=0.1, what="the readiness fact (beat + survivor)",
               check=lambda: env.check_alive(*procs))


async def _round(
    env: BenchEnv, services: Any, settings: dict[str, str], opts: RecoveryOptions, variant: str,
    survivor: Proc, beat: Proc,
) -> dict[str, Any]:
    engine = services.engine
    control = env.celery.control
    await reset_tables(engine)
    victim = env.start_worker("victim", settings, concurrency=opts.concurrency)
    try:
        await env.wait_ready(victim)
        ids = await submit(services, SLEEP, [LONG_SLEEP] * opts.tasks)
        await wait_running(env, engine, ids, procs=[victim, survivor, beat], within=60)
        owners = await _owners(engine, ids)
        if any(not w.startswith(f"{victim.node}:") for w in owners.values()):
            raise BenchError(f"tasks are not all owned by the victim {victim.node}: {owners}")
        # Now a real two-worker cluster: either worker may pick up whatever the recovery publishes.
        await asyncio.to_thread(control.add_consumer, DURABLE_QUEUE, destination=[survivor.node], reply=True)
        if variant == "kill-worker":
            targets = ids
            kill = victim.kill_group
        else:
            targets = ids[:1]
            child = int(owners[targets[0]].rsplit(":", 1)[1])
            if child == victim.pid or child not in worker_pids(victim.pid):
                raise BenchError(f"attempt worker {owners[targets[0]]} is not a pool child of {victim.pid}")

            def kill() -> None:
                os.kill(child, signal.SIGKILL)

        leases = await _leases(engine, targets)
        killed_at = await db_now(engine)  # read before the kill: errs towards a longer recovery
        kill()
        alive = [survivor, beat] + ([victim] if variant == "kill-child" else [])
        await wait_terminal(env, engine, len(targets), procs=alive, ids=targets, interval=0.05,
                            stall_seconds=3 * (opts.lease_seconds + opts.reconcile_seconds) + 30)
    finally:
        env.kill(victim)
        await asyncio.to_thread(control.cancel_consumer, DURABLE_QUEUE, destination=[survivor.node],
                                reply=True)
    async with engine.connect() as conn:
        rows = (await conn.execute(
            text("SELECT id, finished_at, status, error->>'code' AS code FROM tasks WHERE id = ANY(:ids)"),
            {"ids": targets},
        )).mappings().all()
    recovery = [seconds(r["finished_at"] - killed_at) for r in rows]
    tight = [seconds(leases[r["id"]] - killed_at) + opts.reconcile_seconds for r in rows]
    codes = sorted({f"{r['status']}:{r['code']}" for r in rows})
    stats = summarize(recovery)
    return {
        "tasks_killed": len(rows),
        "p50_recovery_seconds": stats["p50"],
        "max_recovery_seconds": stats["max"],
        "max_tight_bound_seconds": max(tight),
        "within_bound": all(r <= t + 0.5 for r, t in zip(recovery, tight, strict=True)),
        "outcomes": codes,
    }


async def _owners(engine: Any, ids: list[Any]) -> dict[Any, str]:
    async with engine.connect() as conn:
        rows = (await conn.execute(
            text("SELECT task_id, worker FROM task_attempts WHERE task_id = ANY(:ids) AND ended_at IS NULL"),
            {"ids": ids},
        )).all()
    return {task_id: worker or "" for task_id, worker in rows}


async def _leases(engine: Any, ids: list[Any]) -> dict[Any, Any]:
    async with engine.connect() as conn:
        rows = (await conn.execute(
            text("SELECT id, lease_expires_at FROM tasks WHERE id = ANY(:ids)"), {"ids": ids}
        )).all()
    return dict(rows)
