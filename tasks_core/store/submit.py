"""Submit and publish: new pending tasks, Idempotency-Keys, the owner's quota, and taking what
capacity can run now for publication."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from tasks_core.store import statements as sql
from tasks_core.store.base import StoreBase, runnable_arrays
from tasks_core.store.execute import Row, run
from tasks_core.store.outcomes import Inserted, NewTask, RunnableSource


class Submit(StoreBase):
    async def insert(self, conn: AsyncConnection, new: NewTask) -> Inserted:
        """Insert a pending task in the caller's transaction (domain rows may share it).

        It has no message yet (``last_published_at`` NULL): after commit the submitter publishes
        what capacity can take, stamping each row before its id is sent (claim_for_publish), so a
        refused claim's "message dropped" mark can never be overwritten by a late stamp.
        """
        for _ in range(5):
            task_id = uuid.uuid4()
            inserted = (
                (
                    await run(
                        conn,
                        sql.INSERT_SQL,
                        self._p(
                            id=task_id,
                            tt=new.task_type,
                            hv=new.handler_version,
                            payload=json.dumps(new.payload),
                            owner=new.owner,
                            dk=new.dedupe_key,
                            timeout=new.timeout_seconds,
                            run_at=new.run_at,
                            delay=new.delay_seconds,
                            prio=new.priority,
                            retry_of=new.retry_of,
                        ),
                    )
                )
                .mappings()
                .first()
            )
            if inserted is not None:
                return Inserted(id=task_id, row=dict(inserted))
            holder = (
                await run(
                    conn,
                    sql.DEDUPE_HOLDER_SQL,
                    {"owner": new.owner, "tt": new.task_type, "dk": new.dedupe_key},
                )
            ).scalar()
            if holder is not None:
                return Inserted(id=holder, duplicate_of=holder)
            # The holder finished between our insert and our look-up: the key is free again.
        raise RuntimeError("dedupe key kept changing hands; giving up")

    async def insert_many(self, conn: AsyncConnection, news: Sequence[NewTask]) -> list[Inserted]:
        """Insert many pending tasks in one statement (in order), in the caller's transaction; an
        entry whose dedupe key an active task of its owner holds (one earlier in the same batch
        included) gets that holder instead of a row."""
        if not news:
            return []
        ids = [uuid.uuid4() for _ in news]
        columns = {
            "ids": ids,
            "types": [n.task_type for n in news],
            "versions": [n.handler_version for n in news],
            "payloads": [json.dumps(n.payload) for n in news],
            "owners": [n.owner for n in news],
            "keys": [n.dedupe_key for n in news],
            "timeouts": [n.timeout_seconds for n in news],
            "run_ats": [n.run_at for n in news],
            "delays": [n.delay_seconds for n in news],
            "prios": [n.priority for n in news],
            "retry_ofs": [n.retry_of for n in news],
        }
        inserted = await run(conn, sql.INSERT_MANY_SQL, self._p(**columns))
        stored = {row["id"]: dict(row) for row in inserted.mappings()}
        out: list[Inserted] = []
        for task_id, new in zip(ids, news, strict=True):
            if task_id in stored:
                out.append(Inserted(id=task_id, row=stored[task_id]))
            else:  # a held dedupe key: the holder (rare enough to look up one by one)
                out.append(await self.insert(conn, new))
        return out

    async def take_idempotency_key(
        self, conn: AsyncConnection, owner: str, key: str, request_hash: str
    ) -> Row | None:
        """Take ``key`` for this request in the caller's transaction: None when it is new (or its
        earlier use expired), else the earlier request's record.

        A concurrent request with the same key waits here (unique index) until the first commits,
        then reads its answer: two racing retries still create one set of tasks.
        """
        params = self._p(owner=owner, key=key, hash=request_hash, ttl=sql.IDEMPOTENCY_TTL_SECONDS)
        if (await run(conn, sql.TAKE_IDEMPOTENCY_KEY_SQL, params)).first() is not None:
            return None
        earlier = (await run(conn, sql.EARLIER_IDEMPOTENCY_KEY_SQL, params)).mappings().first()
        if earlier is None or earlier["expired"]:
            await run(conn, sql.FORGET_IDEMPOTENCY_KEY_SQL, params)
            await run(conn, sql.TAKE_IDEMPOTENCY_KEY_SQL, params)
            return None
        return dict(earlier)

    async def record_idempotent_answer(
        self, conn: AsyncConnection, owner: str, key: str, response: list[dict[str, Any]]
    ) -> None:
        ids = [entry["task_id"] for entry in response if entry.get("task_id")]
        await run(
            conn,
            sql.RECORD_IDEMPOTENT_ANSWER_SQL,
            {"ids": json.dumps(ids), "resp": json.dumps(response), "owner": owner, "key": key},
        )

    async def lock_for_retry(self, conn: AsyncConnection, ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, Row]:
        """The tasks ``ids`` that exist, locked until the caller's transaction ends."""
        rows = (await run(conn, sql.LOCK_FOR_RETRY_SQL, {"ids": list(ids)})).mappings()
        return {row["id"]: dict(row) for row in rows}

    async def mark_retried(self, conn: AsyncConnection, task_id: uuid.UUID, new: uuid.UUID) -> bool:
        """Link ``task_id`` to its retry ``new``; False if it already has one."""
        return (await run(conn, sql.MARK_RETRIED_SQL, {"id": task_id, "new": new})).first() is not None

    async def owner_pending(self, conn: AsyncConnection, owner: str, limit: int) -> int:
        """The owner's pending tasks (counted up to ``limit``), holding the owner's quota lock until
        the caller's transaction ends, so concurrent submissions of one owner cannot overshoot."""
        await run(conn, sql.OWNER_QUOTA_LOCK_SQL, {"owner": owner})
        return int((await run(conn, sql.OWNER_PENDING_SQL, {"owner": owner, "limit": limit})).scalar_one())

    async def mark_publish_failed(self, ids: Sequence[uuid.UUID], error: str) -> None:
        if ids:
            async with self.engine.begin() as conn:
                await run(conn, sql.MARK_PUBLISH_FAILED_SQL, {"ids": list(ids), "err": error[:500]})

    async def claim_for_publish(self, registry: RunnableSource, **options: Any) -> list[uuid.UUID]:
        """The ids ``take_due`` (same options) stamped as published."""
        return [task_id for task_id, _type in await self.take_due(registry, **options)]

    async def take_due(
        self,
        registry: RunnableSource,
        *,
        limit: int,
        republish_after: float | None,
        capacity: int | None = None,
        ahead: int = 0,
        window: float = 60.0,
        owner_max_running: int | None = None,
        conn: AsyncConnection | None = None,
    ) -> list[tuple[uuid.UUID, str]]:
        """The runnable pending tasks the cluster can take now (id, type), higher priority first,
        then older, stamped as published.

        The budget is what capacity can take: ``capacity + ahead`` minus the tasks running and
        minus the messages in flight (pending tasks published within ``window``), so a thousand
        submitted tasks put about capacity + ahead messages on the broker, not a thousand; each
        slot freed later is handed on by the relay. Always due: tasks with no message in flight
        (never sent, or their message was dropped by a refused claim). With ``republish_after``
        (the publisher) also tasks sent longer ago than that, whose message may be lost. Without
        ``capacity``, no budget: up to ``limit``. In ``conn``'s transaction if given (a submission
        stamps its own tasks before its commit, then publishes them).
        """
        params = self._p(
            cap=capacity,
            ahead=ahead,
            window=window,
            limit=limit,
            omax=owner_max_running,
            **runnable_arrays(registry),
        )
        statement = sql.RELAY_DUE_SQL
        if republish_after is not None:
            statement, params["after"] = sql.PUBLISH_DUE_SQL, republish_after
        if conn is None:
            rows = await self._fetch(statement, params)
        else:
            rows = [dict(r) for r in (await run(conn, statement, params)).mappings()]
        due = sorted(rows, key=lambda r: (-r["priority"], r["created_at"], r["id"]))
        return [(r["id"], r["task_type"]) for r in due]
