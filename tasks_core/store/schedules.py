"""The schedules' SQL: create, read, pause and resume, and the scheduler's pass.

Every time comes from PostgreSQL (``NOW``: ``clock_timestamp()``, or the pinned ``:now`` of tests,
as in ``statements``). The pass takes the due schedules (``DUE_SQL``, SKIP LOCKED: two passes at
once share the work and never wait on each other), then one statement (``FIRE_SQL``) inserts a
slot row per schedule, a task for each slot row it managed to insert (the primary key of
``schedule_runs`` refuses a slot fired before, by whatever beat or pass), and advances every
schedule's ``next_run_at``: the instants are computed in Python between the two, in the same
transaction.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tasks_core.schedule_rules import Rule
from tasks_core.store.base import StoreBase
from tasks_core.store.execute import Statement, run
from tasks_core.store.statements import NOW

# Slot rows kept per schedule (the newest): older slots can never be due again, since
# next_run_at only moves forward; the rows beyond these only say which task an old slot made.
KEEP_RUNS = 100

CLOCK_SQL = Statement(f"SELECT {NOW} AS now")
CREATE_SQL = Statement(
    f"""INSERT INTO schedules (id, owner, name, task_type, payload, cron, every_seconds, timezone,
                           priority, next_run_at, created_at)
    VALUES (:id, :owner, :name, :tt, CAST(:payload AS jsonb), :cron, :every, :tz, :prio, :next, {NOW})
    ON CONFLICT (owner, name) DO NOTHING
    RETURNING *"""
)
# One owner's schedules by name, or every owner's (an admin: :owner NULL).
FIND_SQL = Statement(
    """SELECT * FROM schedules WHERE name = :name AND (CAST(:owner AS text) IS NULL OR owner = :owner)
    ORDER BY owner"""
)
LIST_SQL = Statement(
    """SELECT * FROM schedules WHERE CAST(:owner AS text) IS NULL OR owner = :owner
    ORDER BY owner, name LIMIT :limit"""
)
DELETE_SQL = Statement("DELETE FROM schedules WHERE id = :id")
LOCK_SQL = Statement(f"SELECT s.*, {NOW} AS now FROM schedules s WHERE id = :id FOR UPDATE")
PAUSE_SQL = Statement(
    f"UPDATE schedules SET paused_at = coalesce(paused_at, {NOW}) WHERE id = :id RETURNING *"
)
RESUME_SQL = Statement(
    "UPDATE schedules SET paused_at = NULL, next_run_at = :next WHERE id = :id RETURNING *"
)
# The due schedules, oldest slot first, locked for this pass (others skip them), with the one
# instant the pass reads as now.
DUE_SQL = Statement(
    f"""WITH clock AS (SELECT {NOW} AS now)
    SELECT s.*, clock.now FROM schedules s, clock
    WHERE s.paused_at IS NULL AND s.next_run_at <= clock.now
    ORDER BY s.next_run_at LIMIT :limit
    FOR UPDATE OF s SKIP LOCKED"""
)
# The pass's one write. Per schedule (arrays, in step): its slot, its next slot, and either the new
# task's id, version and timeout or the error that stops it from making one. A slot row that is
# already there inserts nothing, and so no task: one task per (schedule, slot), whatever ran before.
FIRE_SQL = Statement(
    f"""WITH fire AS (
        SELECT * FROM unnest(CAST(:ids AS uuid[]), CAST(:slots AS timestamptz[]),
                             CAST(:nexts AS timestamptz[]), CAST(:tasks AS uuid[]),
                             CAST(:versions AS int[]), CAST(:timeouts AS float8[]), CAST(:errors AS text[]))
            AS f(schedule_id, slot_at, next_run_at, task_id, hv, timeout, error)),
    advanced AS (
        UPDATE schedules s SET next_run_at = fire.next_run_at, last_fired_at = {NOW}, last_error = fire.error
        FROM fire WHERE s.id = fire.schedule_id
        RETURNING s.id, s.owner, s.task_type, s.payload, s.priority),
    slot AS (
        INSERT INTO schedule_runs (schedule_id, slot_at, task_id, created_at)
        SELECT schedule_id, slot_at, task_id, {NOW} FROM fire WHERE task_id IS NOT NULL
        ON CONFLICT (schedule_id, slot_at) DO NOTHING
        RETURNING schedule_id, slot_at, task_id)
    INSERT INTO tasks (id, task_type, handler_version, payload, owner, status, timeout_seconds,
                       created_at, run_at, not_before, priority)
    SELECT slot.task_id, a.task_type, fire.hv, a.payload, a.owner, 'pending', fire.timeout,
           {NOW}, slot.slot_at, slot.slot_at, a.priority
    FROM slot JOIN fire ON fire.schedule_id = slot.schedule_id JOIN advanced a ON a.id = slot.schedule_id
    RETURNING id, task_type"""
)
TRIM_RUNS_SQL = Statement(
    """DELETE FROM schedule_runs r WHERE r.schedule_id = ANY(CAST(:ids AS uuid[]))
      AND r.slot_at < (SELECT k.slot_at FROM schedule_runs k WHERE k.schedule_id = r.schedule_id
                       ORDER BY k.slot_at DESC OFFSET :keep - 1 LIMIT 1)"""
)
# A schedule's newest slots and what became of their tasks (NULL status: the task was pruned).
RUNS_SQL = Statement(
    """SELECT r.slot_at, r.task_id, r.created_at, t.status FROM schedule_runs r
    LEFT JOIN tasks t ON t.id = r.task_id
    WHERE r.schedule_id = :id ORDER BY r.slot_at DESC LIMIT :limit"""
)


@dataclass(frozen=True)
class NewSchedule:
    """A schedule as stored (tasks_core.schedules.validate_schedule makes them)."""

    name: str
    owner: str
    task_type: str
    payload: dict[str, Any]
    rule: Rule
    priority: int


class HasTaskStore(Protocol):
    """What ``ScheduleStore.of`` needs of the services: the engine, and the TaskStore whose clock
    it follows."""

    @property
    def engine(self) -> AsyncEngine: ...

    @property
    def repo(self) -> StoreBase: ...


@dataclass(frozen=True)
class Fire:
    """What one pass does with one due schedule: fire ``slot`` (a task ``task_id`` of ``version``
    and ``timeout``, or none, for ``error``) and move on to ``next_run_at``."""

    schedule_id: uuid.UUID
    slot: datetime
    next_run_at: datetime
    task_id: uuid.UUID | None = None
    version: int | None = None
    timeout: float | None = None
    error: str | None = None


class ScheduleStore:
    """Tests may pin "now" (``now``), as on the TaskStore; ``of(services)`` follows the TaskStore's
    (read at each statement, so a test that moves the repository's clock moves this one too)."""

    def __init__(self, engine: AsyncEngine, *, now: datetime | None = None, clock: Any = None) -> None:
        self.engine = engine
        self._now = now
        self._clock = clock  # an object whose ``now`` is the pinned instant (the TaskStore)

    @classmethod
    def of(cls, services: HasTaskStore) -> ScheduleStore:
        return cls(services.engine, clock=services.repo)

    @property
    def now(self) -> datetime | None:
        pinned: datetime | None = self._clock.now if self._clock is not None else self._now
        return pinned

    def _p(self, **params: Any) -> dict[str, Any]:
        return {"now": self.now, **params}

    async def clock(self, conn: AsyncConnection) -> datetime:
        now: datetime = (await run(conn, CLOCK_SQL, self._p())).scalar_one()
        return now

    async def create(self, new: NewSchedule) -> dict[str, Any] | None:
        """The stored schedule, or None when its owner already has one of that name."""
        async with self.engine.begin() as conn:
            now = await self.clock(conn)
            rule = new.rule
            params = self._p(
                id=uuid.uuid4(),
                owner=new.owner,
                name=new.name,
                tt=new.task_type,
                payload=json.dumps(new.payload),
                cron=rule.cron,
                every=rule.every_seconds,
                tz=rule.timezone,
                prio=new.priority,
                next=rule.first(now),
            )
            row = (await run(conn, CREATE_SQL, params)).mappings().first()
        return None if row is None else dict(row)

    async def find(self, name: str, owner: str | None) -> list[dict[str, Any]]:
        async with self.engine.connect() as conn:
            return [dict(r) for r in (await run(conn, FIND_SQL, {"name": name, "owner": owner})).mappings()]

    async def listed(self, owner: str | None, limit: int = 1000) -> list[dict[str, Any]]:
        async with self.engine.connect() as conn:
            return [dict(r) for r in (await run(conn, LIST_SQL, {"owner": owner, "limit": limit})).mappings()]

    async def delete(self, schedule_id: uuid.UUID) -> None:
        """The schedule and its slot rows; the tasks it created stay."""
        async with self.engine.begin() as conn:
            await run(conn, DELETE_SQL, {"id": schedule_id})

    async def pause(self, schedule_id: uuid.UUID) -> dict[str, Any] | None:
        async with self.engine.begin() as conn:
            row = (await run(conn, PAUSE_SQL, self._p(id=schedule_id))).mappings().first()
        return None if row is None else dict(row)

    async def resume(self, schedule_id: uuid.UUID) -> dict[str, Any] | None:
        """Active again from now on: the next slot is the first after now (nothing missed while
        paused fires). Resuming an active schedule changes nothing."""
        async with self.engine.begin() as conn:
            found = (await run(conn, LOCK_SQL, self._p(id=schedule_id))).mappings().first()
            locked = None if found is None else dict(found)
            if locked is None or locked["paused_at"] is None:
                return None if locked is None else {k: v for k, v in locked.items() if k != "now"}
            nxt = Rule.of_row(locked).resumed(locked["next_run_at"], locked["now"])
            row = (await run(conn, RESUME_SQL, {"id": schedule_id, "next": nxt})).mappings().first()
        return None if row is None else dict(row)

    async def due(self, conn: AsyncConnection, limit: int) -> list[dict[str, Any]]:
        """The due, active schedules (each row with the pass's ``now``), locked in ``conn``'s
        transaction; those another pass holds are skipped."""
        return [dict(r) for r in (await run(conn, DUE_SQL, self._p(limit=limit))).mappings()]

    async def fire(self, conn: AsyncConnection, fires: Sequence[Fire]) -> list[tuple[uuid.UUID, str]]:
        """Fire each slot and advance each schedule, in one statement; the tasks created (id, type)."""
        if not fires:
            return []
        params = self._p(
            ids=[f.schedule_id for f in fires],
            slots=[f.slot for f in fires],
            nexts=[f.next_run_at for f in fires],
            tasks=[f.task_id for f in fires],
            versions=[f.version for f in fires],
            timeouts=[f.timeout for f in fires],
            errors=[f.error for f in fires],
        )
        created = [(r["id"], r["task_type"]) for r in (await run(conn, FIRE_SQL, params)).mappings()]
        fired = [f.schedule_id for f in fires if f.task_id is not None]
        if fired:
            await run(conn, TRIM_RUNS_SQL, {"ids": fired, "keep": KEEP_RUNS})
        return created

    async def runs(self, schedule_id: uuid.UUID, limit: int = 10) -> list[dict[str, Any]]:
        async with self.engine.connect() as conn:
            rows = await run(conn, RUNS_SQL, {"id": schedule_id, "limit": limit})
            return [dict(r) for r in rows.mappings()]
