"""Reads: one task, its attempts, the listing, counts, and the facts behind a waiting reason."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy.exc import DBAPIError

from tasks_core import cursor as keyset
from tasks_core import views
from tasks_core.model import Status
from tasks_core.store import statements as sql
from tasks_core.store.base import StoreBase
from tasks_core.store.execute import Row, Rows, run
from tasks_core.store.outcomes import WaitingFacts


def encode_cursor(created_at: datetime, task_id: uuid.UUID) -> str:
    return keyset.encode_cursor(created_at, task_id)


def decode_cursor(cursor: str) -> tuple[datetime, uuid.UUID]:
    return keyset.decode_cursor(cursor, uuid.UUID)


class Reads(StoreBase):
    async def get(self, task_id: uuid.UUID) -> Row | None:
        async with self.engine.connect() as conn:
            row = (await run(conn, sql.GET_SQL, {"id": task_id})).mappings().first()
        return None if row is None else dict(row)

    async def waiting_facts(self, row: Row) -> WaitingFacts:
        """What the database says about a pending task that is not running yet. It names only
        the task's own owner's queue (never the cluster's backlog, which would tell one tenant
        about the others), and counts at most WAITING_COUNT_CAP rows: the cost stays flat however
        many tasks are pending."""
        statement = sql.WAITING_FACTS_SQL[row["owner"] is None]
        params = self._p(
            nb=row["not_before"], created=row["created_at"], id=row["id"], owner=row["owner"],
            tt=row["task_type"],
        )  # fmt: skip
        async with self.engine.connect() as conn:
            facts = (await run(conn, statement, params)).mappings().one()
        return WaitingFacts(
            backoff=bool(facts["backoff"]),
            paused=bool(facts["paused"]),
            running=int(facts["running"]),
            mine_running=int(facts["mine_running"]),
            ahead=int(facts["ahead"]),
        )

    async def waiting_reason(
        self, row: Row, capacity: int, *, owner_max_running: int | None = None
    ) -> str | None:
        """Why a pending task is not running yet, in words a user can act on (views.waiting_reason
        phrases the facts; the database is asked only when the row alone does not tell)."""
        facts = await self.waiting_facts(row) if views.needs_waiting_facts(row) else None
        return views.waiting_reason(row, facts, capacity, owner_max_running=owner_max_running)

    async def summary(self, owner: str | None = None) -> dict[str, Any]:
        """Exact counts by status and by type (one owner's tasks, or all)."""
        statement, params = sql.SUMMARY_SQL, {}
        if owner is not None:
            statement, params = sql.OWNER_SUMMARY_SQL, {"owner": owner}
        async with self.engine.connect() as conn:
            rows = (await run(conn, statement, params)).all()
        by_status: dict[str, int] = {s.value: 0 for s in Status}
        by_type: dict[str, dict[str, int]] = {}
        for task_type, status, count in rows:
            by_status[status] += count
            by_type.setdefault(task_type, {})[status] = count
        return {"total": sum(by_status.values()), "by_status": by_status, "by_type": by_type}

    async def oldest_pending_age(self) -> float | None:
        """Seconds since the oldest pending task was created (None when nothing waits)."""
        async with self.engine.connect() as conn:
            age = (await run(conn, sql.OLDEST_PENDING_AGE_SQL, self._p())).scalar()
        return None if age is None else float(age)

    async def list(
        self,
        *,
        status: str | None = None,
        task_type: str | None = None,
        owner: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> tuple[Rows, str | None]:
        """Newest first, keyset-paged on (created_at, id): cost does not grow with the page number.

        Only the filters given become predicates (see statements.list_sql).
        """
        if limit < 1:
            raise ValueError("limit must be at least 1")
        conds: list[str] = []
        params: dict[str, Any] = {"limit": limit + 1}
        if status is not None:
            conds.append(sql.LIST_STATUS)
            params["status"] = status
        if task_type is not None:
            conds.append(sql.LIST_TYPE)
            params["tt"] = task_type
        if owner is not None:
            conds.append(sql.LIST_OWNER)
            params["owner"] = owner
        if cursor:
            params["c_at"], params["c_id"] = decode_cursor(cursor)
            conds.append(sql.LIST_AFTER)
        async with self.engine.connect() as conn:
            rows = (await run(conn, sql.list_sql(conds), params)).mappings().all()
        items: Rows = [dict(r) for r in rows[:limit]]
        nxt = encode_cursor(items[-1]["created_at"], items[-1]["id"]) if len(rows) > limit else None
        return items, nxt

    async def attempts(self, task_id: uuid.UUID) -> Rows:
        async with self.engine.connect() as conn:
            rows = (await run(conn, sql.ATTEMPTS_SQL, {"id": task_id})).mappings().all()
        return [dict(r) for r in rows]

    async def schema_revision(self) -> str | None:
        try:
            async with self.engine.connect() as conn:
                revision = (await run(conn, sql.SCHEMA_REVISION_SQL)).scalar()
                return None if revision is None else str(revision)
        except DBAPIError:
            return None
