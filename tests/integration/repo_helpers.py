"""Shared helpers for the repository integration tests: create tasks, claim them, read state back.

Everything here talks to the real test database; nothing is mocked. Reads go straight to the
tables so a test asserts what PostgreSQL holds, not what the repository says it did.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from domains.diagnostics.model import diagnostics_effects, diagnostics_runs
from tasks_core.registry import Registry
from tasks_core.store.facade import TaskStore
from tasks_core.store.outcomes import Claim, NewTask

LONG_LEASE = 30.0


async def sleep_past(engine: AsyncEngine, instant: datetime) -> None:
    """Sleep until PostgreSQL's clock has passed ``instant`` (real short leases only)."""
    left = (instant - await db_now(engine)).total_seconds()
    if left >= 0:
        await asyncio.sleep(left + 0.02)
    assert await db_now(engine) > instant


async def db_now(engine: AsyncEngine) -> datetime:
    """PostgreSQL's clock: the only clock leases are judged by (I7)."""
    async with engine.connect() as conn:
        return (await conn.execute(text("SELECT clock_timestamp()"))).scalar_one()  # type: ignore[no-any-return]


def at(engine: AsyncEngine, now: datetime) -> TaskStore:
    """A repository whose every statement sees ``now`` instead of clock_timestamp()."""
    return TaskStore(engine, now=now)


async def submit(
    repo: TaskStore,
    task_type: str = "diagnostics.sleep",
    payload: dict[str, Any] | None = None,
    *,
    version: int = 1,
    dedupe_key: str | None = None,
    owner: str | None = None,
    timeout_seconds: float = 60.0,
) -> uuid.UUID:
    """Store one pending task through the repository (no publication)."""
    async with repo.engine.begin() as conn:
        inserted = await repo.insert(
            conn,
            NewTask(
                task_type=task_type,
                handler_version=version,
                payload=payload or {},
                timeout_seconds=timeout_seconds,
                dedupe_key=dedupe_key,
                owner=owner,
            ),
        )
    assert inserted.duplicate_of is None
    return inserted.id


async def claim(
    repo: TaskStore,
    registry: Registry,
    task_id: uuid.UUID,
    *,
    lease: float = LONG_LEASE,
    capacity: int = 100,  # set-up helper: capacity has tests of its own
    worker: str = "worker-a",
) -> Claim:
    got = await repo.claim(task_id, registry, capacity=capacity, lease_seconds=lease, worker=worker)
    assert isinstance(got, Claim), f"claim of {task_id} refused: {got}"
    return got


async def start_run_row(repo: TaskStore, task_id: uuid.UUID, token: uuid.UUID) -> None:
    """What diagnostics.sleep does first: mark its domain row in progress as the owner."""
    async with repo.owning_transaction(task_id, token) as (conn, _row):
        await conn.execute(
            diagnostics_runs.insert().values(task_id=task_id, attempt_token=token, status="running")
        )


async def running_task(
    repo: TaskStore,
    registry: Registry,
    task_type: str = "diagnostics.sleep",
    payload: dict[str, Any] | None = None,
    *,
    lease: float = LONG_LEASE,
    dedupe_key: str | None = None,
) -> tuple[uuid.UUID, Claim]:
    """A claimed task whose diagnostics_runs row is in progress (owned by the claim's attempt)."""
    task_id = await submit(repo, task_type, payload, dedupe_key=dedupe_key)
    got = await claim(repo, registry, task_id, lease=lease)
    await start_run_row(repo, task_id, got.token)
    return task_id, got


async def insert_raw(
    engine: AsyncEngine,
    *,
    task_type: str = "diagnostics.sleep",
    version: int = 1,
    status: str = "pending",
    payload: dict[str, Any] | None = None,
    lease_expires_at: datetime | None = None,
    created_at: datetime | None = None,
    finished_at: datetime | None = None,
    cancel_requested_at: datetime | None = None,
    not_before: datetime | None = None,
    owner: str | None = None,
    run_row: bool = False,
) -> uuid.UUID:
    """Insert a row the way an older release (or another deployment) may have left it."""
    task_id = uuid.uuid4()
    token = uuid.uuid4() if status == "running" else None
    if status == "running" and lease_expires_at is None:
        raise ValueError("a running row needs a lease")
    async with engine.begin() as conn:
        await conn.execute(
            text(
                """INSERT INTO tasks (id, task_type, handler_version, payload, owner, status, attempt_token,
                       attempt_count, lease_expires_at, heartbeat_at, timeout_seconds, created_at,
                       started_at, finished_at, cancel_requested_at, not_before)
                VALUES (:id, :tt, :hv, CAST(:payload AS jsonb), :owner, :status, :tok, :count, :lease,
                        CAST(:lease AS timestamptz) - interval '30 seconds', 60,
                        coalesce(CAST(:created AS timestamptz), clock_timestamp()),
                        CAST(:started AS timestamptz), CAST(:finished AS timestamptz),
                        CAST(:cancel AS timestamptz), CAST(:nb AS timestamptz))"""
            ),
            {
                "id": task_id,
                "tt": task_type,
                "hv": version,
                "payload": json.dumps(payload or {}),
                "owner": owner,
                "status": status,
                "tok": token,
                "count": 1 if token else 0,
                "lease": lease_expires_at,
                "created": created_at,
                "started": (lease_expires_at - timedelta(seconds=30)) if lease_expires_at else None,
                "finished": finished_at,
                "cancel": cancel_requested_at,
                "nb": not_before,
            },
        )
        if run_row:
            await conn.execute(
                diagnostics_runs.insert().values(task_id=task_id, attempt_token=token, status="running")
            )
    return task_id


async def task_row(engine: AsyncEngine, task_id: uuid.UUID) -> dict[str, Any]:
    async with engine.connect() as conn:
        row = (
            (await conn.execute(text("SELECT * FROM tasks WHERE id = :id"), {"id": task_id})).mappings().one()
        )
    return dict(row)


async def attempt_rows(engine: AsyncEngine, task_id: uuid.UUID | None = None) -> list[dict[str, Any]]:
    """One task's attempts in order, or (no ``task_id``) every attempt in the order they were claimed."""
    sql = (
        "SELECT * FROM task_attempts ORDER BY claimed_at, id"
        if task_id is None
        else "SELECT * FROM task_attempts WHERE task_id = :id ORDER BY attempt"
    )
    async with engine.connect() as conn:
        rows = (await conn.execute(text(sql), {"id": task_id})).mappings().all()
    return [dict(r) for r in rows]


async def run_row(engine: AsyncEngine, task_id: uuid.UUID) -> dict[str, Any] | None:
    async with engine.connect() as conn:
        row = (
            (await conn.execute(diagnostics_runs.select().where(diagnostics_runs.c.task_id == task_id)))
            .mappings()
            .first()
        )
    return None if row is None else dict(row)


async def effect_rows(engine: AsyncEngine, task_id: uuid.UUID) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        rows = (
            (
                await conn.execute(
                    diagnostics_effects.select()
                    .where(diagnostics_effects.c.task_id == task_id)
                    .order_by(diagnostics_effects.c.id)
                )
            )
            .mappings()
            .all()
        )
    return [dict(r) for r in rows]


async def scalar(engine: AsyncEngine, sql: str, **params: Any) -> Any:
    async with engine.connect() as conn:
        return (await conn.execute(text(sql), params)).scalar()


async def wait_until_blocked_on_a_lock(engine: AsyncEngine, patience: float = 5.0) -> None:
    """Poll pg_stat_activity until some backend of this database waits on a heavyweight lock."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience
    while loop.time() < deadline:
        if await scalar(
            engine,
            """SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
               AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()""",
        ):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("no session ever waited on a lock")
