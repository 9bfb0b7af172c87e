"""`dtask bench scale`: does the cost of a task's statements grow with the size of the table?

Two scratch databases are loaded with one ``INSERT … SELECT generate_series`` per table: ``small``
(10 thousand terminal tasks of history, with their attempts and domain rows, plus 1 thousand pending)
and ``large`` (1 million of history, 100 thousand pending). Then, in alternating rounds, the
repository methods run in this process, each op timed on its own (median and p99 per op):

- ``insert`` (a submit's transaction), ``claim`` and ``finish`` (the terminal transaction with the
  diagnostics hook) of M fresh no-op tasks — these must stay flat as history grows;
- ``publish``: ``TaskStore.claim_for_publish`` of one publisher batch over the pending rows
  (the stamps it writes are reset between calls, so every call sees the same table; a VACUUM
  afterwards clears the dead row versions that churn leaves);
- ``summary``: the per-status counts of ``GET /tasks/summary``;
- ``view``: what ``GET /tasks/{id}`` reads for the newest pending task (the row and its
  ``waiting_reason``, which must not count every older pending row).

The M tasks are deleted after each round so both databases keep their size.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tasks_core.db import make_engine
from tasks_core.devkit.bench.common import BenchEnv, CommonOptions, client_settings, public_options
from tasks_core.devkit.bench.report import Document, Rounds, alternate, ratio, summarize
from tasks_core.model import Status
from tasks_core.registry import default_registry
from tasks_core.store.facade import TaskStore
from tasks_core.store.outcomes import NewTask

OPS = ("insert", "claim", "finish", "publish", "summary", "view")

# Terminal history: mostly successes, some failures and cancellations, one per second going back,
# each with its attempt and its diagnostics row, as the real path leaves them.
HISTORY_SQL = """
INSERT INTO tasks (id, task_type, handler_version, payload, owner, status, timeout_seconds, progress,
                   attempt_count, result, error, created_at, started_at, finished_at)
SELECT gen_random_uuid(), 'diagnostics.noop', 1, '{}', 'bench-history', st, 60,
       CASE WHEN st = 'success' THEN 100 ELSE 0 END, 1,
       CASE WHEN st = 'success' THEN '{}'::jsonb END,
       CASE WHEN st <> 'success' THEN jsonb_build_object('code', st, 'message', 'history') END,
       at, at + interval '1 second', at + interval '2 seconds'
FROM (SELECT (ARRAY['success', 'success', 'success', 'failed', 'cancelled'])[1 + i % 5] AS st,
             clock_timestamp() - make_interval(secs => :offset + i) AS at
      FROM generate_series(1, :n) AS i) AS h
"""
ATTEMPTS_SQL = """
INSERT INTO task_attempts (task_id, attempt, token, worker, claimed_at, ended_at, outcome)
SELECT id, 1, gen_random_uuid(), 'bench-history', started_at, finished_at, status
FROM tasks WHERE owner = 'bench-history'
"""
RUNS_SQL = """
INSERT INTO diagnostics_runs (task_id, status, hook)
SELECT id, CASE status WHEN 'success' THEN 'done' ELSE status END, 'history:' || status
FROM tasks WHERE owner = 'bench-history'
"""
# Pending intents nobody has published yet, older than anything the rounds insert.
PENDING_SQL = """
INSERT INTO tasks (id, task_type, handler_version, payload, owner, status, timeout_seconds, created_at)
SELECT gen_random_uuid(), 'diagnostics.noop', 1, '{}', 'bench-pending', 'pending', 60,
       clock_timestamp() - make_interval(secs => i / 1000.0)
FROM generate_series(1, :n) AS i
"""


@dataclass
class ScaleOptions(CommonOptions):
    history_small: int = 10_000
    history_large: int = 1_000_000
    pending_small: int = 1_000
    pending_large: int = 100_000
    ops: int = 500
    publish_calls: int = 50
    publish_batch: int = 500
    summary_calls: int = 5
    view_calls: int = 50


QUICK = {"history_small": 1_000, "history_large": 20_000, "pending_small": 100, "pending_large": 2_000,
         "ops": 20, "publish_calls": 5, "publish_batch": 50, "summary_calls": 2, "view_calls": 5,
         "rounds": 1}


def run(opts: ScaleOptions) -> dict[str, Any]:
    return asyncio.run(_run(opts))


async def _run(opts: ScaleOptions) -> dict[str, Any]:
    sizes = {
        "small": (opts.history_small, opts.pending_small),
        "large": (opts.history_large, opts.pending_large),
    }
    variants = {name: f"{h:,} terminal tasks of history, {p:,} pending" for name, (h, p) in sizes.items()}
    doc = Document("scale", public_options(opts), quick=opts.quick)
    rounds = Rounds(variants)
    samples: dict[str, dict[str, list[float]]] = {v: {op: [] for op in OPS} for v in variants}
    engines: dict[str, AsyncEngine] = {}
    async with BenchEnv("scale", opts) as env:
        try:
            for name, (history, pending) in sizes.items():
                engines[name] = make_engine(await env.create_database(name), pool_size=2)
                rounds.extra[name]["load_seconds"] = await _load(engines[name], history, pending)
            registry = default_registry()
            publish_after = client_settings("", env.broker).publish_seconds
            doc.settings.update(publish_republish_after_seconds=publish_after, claim_capacity=4,
                                lease_seconds=30.0)
            for round_no, seq, name in alternate(list(variants), opts.rounds):
                repo = TaskStore(engines[name])
                times = await _round(repo, registry, opts, publish_after)
                for op, values in times.items():
                    samples[name][op] += values
                rounds.add(name, round_no, seq, {
                    **{f"{op}_median_ms": summarize(v)["median"] for op, v in times.items()},
                    **{f"{op}_p99_ms": summarize(v)["p99"] for op, v in times.items()},
                })
        finally:
            for engine in engines.values():
                await engine.dispose()
    for name in variants:
        rounds.extra[name]["pooled_ms"] = {op: summarize(v) for op, v in samples[name].items()}
    doc.data["variants"] = rounds.to_json()
    rows = []
    for op in OPS:
        small = rounds.extra["small"]["pooled_ms"][op]["median"]
        large = rounds.extra["large"]["pooled_ms"][op]["median"]
        doc.data["ratios"][f"{op}: large / small (median)"] = ratio(large, small)
        rows.append([op, small, rounds.extra["small"]["pooled_ms"][op]["p99"], large,
                     rounds.extra["large"]["pooled_ms"][op]["p99"], ratio(large, small)])
    doc.table(
        f"scale (ms per op): small = {opts.history_small:,} history / {opts.pending_small:,} pending, "
        f"large = {opts.history_large:,} / {opts.pending_large:,}",
        ["op", "small p50", "small p99", "large p50", "large p99", "large/small"], rows,
    )
    doc.note(f"publish = one claim_for_publish of {opts.publish_batch} over the pending rows; summary = "
             "exact counts over the whole table (expected to grow with it)")
    return doc.finish()


async def _load(engine: AsyncEngine, history: int, pending: int) -> float:
    started = time.monotonic()
    async with engine.begin() as conn:
        # Offset past the pending rows' ages so history is older than every pending task.
        await conn.execute(text(HISTORY_SQL), {"n": history, "offset": pending})
        await conn.execute(text(ATTEMPTS_SQL))
        await conn.execute(text(RUNS_SQL))
        await conn.execute(text(PENDING_SQL), {"n": pending})
    # Fresh statistics and a visibility map, as a table that grew over months would have.
    await _vacuum(engine, "ANALYZE tasks, task_attempts, diagnostics_runs")
    return time.monotonic() - started


async def _vacuum(engine: AsyncEngine, what: str) -> None:
    # VACUUM cannot run inside a transaction block.
    async with engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        await conn.execute(text(f"VACUUM {what}"))


async def _timed(fn: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
    started = time.perf_counter()
    value = await fn()
    return (time.perf_counter() - started) * 1000, value


async def _round(
    repo: TaskStore, registry: Any, opts: ScaleOptions, publish_after: float
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {op: [] for op in OPS}
    new = NewTask("diagnostics.noop", 1, {}, 60.0, owner="bench-round")
    ids = []
    for _ in range(opts.ops):
        async def insert() -> Any:
            async with repo.engine.begin() as conn:
                return (await repo.insert(conn, new)).id

        ms, task_id = await _timed(insert)
        times["insert"].append(ms)
        ids.append(task_id)
    for task_id in ids:
        ms, claim = await _timed(partial(repo.claim, task_id, registry, capacity=4, lease_seconds=30.0))
        if isinstance(claim, str):
            raise RuntimeError(f"claim refused: {claim}")
        times["claim"].append(ms)
        ms, _ = await _timed(partial(repo.finish, task_id, claim.token, registry, status=Status.SUCCESS,
                                     result={}))
        times["finish"].append(ms)
    async with repo.engine.begin() as conn:
        await conn.execute(text("DELETE FROM tasks WHERE owner = 'bench-round'"))
    for _ in range(opts.publish_calls):
        ms, got = await _timed(partial(repo.claim_for_publish, registry, limit=opts.publish_batch,
                                       republish_after=publish_after))
        times["publish"].append(ms)
        # Undo the stamps so the next call sees the same never-published backlog.
        async with repo.engine.begin() as conn:
            await conn.execute(text("UPDATE tasks SET last_published_at = NULL WHERE id = ANY(:ids)"),
                               {"ids": got})
    # Stamping and resetting the same rows fifty times leaves a hundred dead versions of each: clear
    # them as autovacuum would, or the later reads and rounds pay for them, not for the size of the
    # table (the view measured 0.59x, 2.65 vs 1.56 ms, and publish grew round by round).
    await _vacuum(repo.engine, "tasks")
    for _ in range(opts.summary_calls):
        ms, _ = await _timed(repo.summary)
        times["summary"].append(ms)
    async with repo.engine.connect() as conn:
        newest = (await conn.execute(text(
            "SELECT id FROM tasks WHERE status = 'pending' ORDER BY created_at DESC, id DESC LIMIT 1"
        ))).scalar_one()

    async def view() -> Any:
        row = await repo.get(newest)
        assert row is not None
        return await repo.waiting_reason(row, 4)

    for _ in range(opts.view_calls):
        ms, _ = await _timed(view)
        times["view"].append(ms)
    return times
