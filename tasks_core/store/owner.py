"""The owner's writes: heartbeat, progress, a transaction as the owner, the terminal write (with
its relay) and the hand-back to pending. Each is fenced by the attempt's token and live lease."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from tasks_core.db import is_transient
from tasks_core.model import Status
from tasks_core.store import statements as sql
from tasks_core.store.base import finished, runnable_arrays, terminal_params
from tasks_core.store.execute import Row, run
from tasks_core.store.outcomes import Finished, Heartbeat, HookFailed, HookSource, OwnershipLost, RelayOptions
from tasks_core.store.transitions import Transitions


class OwnerWrites(Transitions):
    async def heartbeat(self, task_id: uuid.UUID, token: uuid.UUID, lease_seconds: float) -> Heartbeat:
        async with self._autocommit() as conn:
            row = (
                await run(conn, sql.HEARTBEAT_SQL, self._p(id=task_id, tok=token, lease=lease_seconds))
            ).first()
        return Heartbeat(owned=False) if row is None else Heartbeat(owned=True, cancel_requested=row[0])

    async def report(
        self, task_id: uuid.UUID, token: uuid.UUID, progress: float | None, message: str | None
    ) -> bool:
        async with self._autocommit() as conn:
            result = await run(
                conn, sql.REPORT_SQL, self._p(id=task_id, tok=token, progress=progress, message=message)
            )
        return bool(result.rowcount)

    @asynccontextmanager
    async def owning_transaction(
        self, task_id: uuid.UUID, token: uuid.UUID
    ) -> AsyncIterator[tuple[AsyncConnection, Row]]:
        """Lock the task row as its live owner, let the caller write, re-check the lease, commit.

        A lapse while the caller ran or waited for a lock raises OwnershipLost and rolls back
        everything written in the block.
        """
        async with self.engine.connect() as conn, conn.begin():
            row = (await run(conn, sql.LOCK_OWNED_SQL, self._p(id=task_id, tok=token))).mappings().first()
            if row is None:
                raise OwnershipLost(str(task_id))
            yield conn, dict(row)
            # The row lock kept everyone else off the lease, so the value we locked still holds;
            # the block itself may have ended the lease (a terminal write clears it).
            await self._recheck_lease(conn, task_id, row["lease_expires_at"])

    async def finish(
        self,
        task_id: uuid.UUID,
        token: uuid.UUID,
        hooks: HookSource | None,
        *,
        status: Status,
        result: Any = None,
        error: dict[str, str] | None = None,
        detail: str | None = None,
        kind: tuple[str, int] | None = None,
    ) -> Status:
        """The owner's terminal write (see finish_and_relay), without the relay."""
        done = await self.finish_and_relay(
            task_id, token, hooks, status=status, result=result, error=error, detail=detail, kind=kind
        )
        return done.status

    async def finish_and_relay(
        self,
        task_id: uuid.UUID,
        token: uuid.UUID,
        hooks: HookSource | None,
        *,
        status: Status,
        result: Any = None,
        error: dict[str, str] | None = None,
        detail: str | None = None,
        kind: tuple[str, int] | None = None,
        relay: RelayOptions | None = None,
    ) -> Finished:
        """The owner's terminal write: status, attempt record, capacity slot and dedupe key given
        back, in one fenced statement; then the type's hook, in the same transaction. With
        ``relay``, the same statement stamps what the freed slot can take next (the relay's work)
        and returns it, to be published once this commit is done.

        Cancel intent beats a concurrent success. Raises OwnershipLost (nothing written) if the
        attempt no longer owns the task; a hook's exception rolls everything back and is raised as
        HookFailed (a transient database error inside the hook as itself, to be retried). Once the
        statement has ended the lease the row stays locked until commit, so no other attempt can
        own the task while the hook runs.
        """
        outcome = error["code"] if error else status.value
        params = self._p(
            id=task_id,
            tok=token,
            **terminal_params(status, outcome=outcome, detail=detail, result=result, error=error),
            **self._due_params(relay),
        )
        success_hook = failure_hook = None
        if hooks is not None:
            # (type, version): given by the owner, who knows it; a row's type never changes.
            task_type = kind or await self._task_type(task_id)
            if task_type is not None:
                success_hook = hooks.hook_for(task_type[0], task_type[1], "success")
                failure_hook = hooks.hook_for(task_type[0], task_type[1], "failure")
        if success_hook is None and failure_hook is None:  # no hook to run: one round trip
            ended = next(iter(await self._fetch(sql.FINISH_SQL, params)), None)
            if ended is None:
                raise OwnershipLost(str(task_id))
            return finished(ended)
        async with self.engine.begin() as conn:
            row = (await run(conn, sql.FINISH_SQL, params)).mappings().first()
            if row is None:
                raise OwnershipLost(str(task_id))
            # The final status decides the hook (cancel intent turns a success into `cancelled`);
            # the hook sees the row as the ending attempt left it, with that attempt's token.
            final = Status(row["status"])
            task = {**row, "attempt_token": token}
            for relay_column in ("relay_ids", "relay_types"):
                task.pop(relay_column, None)
            final_hook = success_hook if final == Status.SUCCESS else failure_hook
            if final_hook is not None:
                try:
                    await final_hook(conn, task, final.value)
                except Exception as exc:
                    if is_transient(exc):
                        raise
                    which = "success" if final == Status.SUCCESS else "failure"
                    raise HookFailed(
                        f"the {which} hook of {task['task_type']} raised {type(exc).__name__}"
                    ) from exc
                # The hook wrote as the owner: commit only if the lease it ended still held.
                await self._recheck_lease(conn, task_id, row["lease_was"])
        return finished(dict(row))

    def _due_params(self, relay: RelayOptions | None) -> dict[str, Any]:
        """take_due's parameters for a terminal write's relay (limit 0: no relay)."""
        if relay is None:
            return {"cap": None, "ahead": 0, "window": 0.0, "limit": 0, "omax": None,
                    "types": [], "versions": []}
        return {"cap": relay.capacity, "ahead": relay.ahead, "window": relay.window,
                "limit": relay.limit, "omax": relay.owner_max_running,
                **runnable_arrays(relay.registry)}

    async def _recheck_lease(self, conn: AsyncConnection, task_id: uuid.UUID, lease: datetime) -> None:
        still = (await run(conn, sql.LEASE_HOLDS_SQL, self._p(lease=lease))).scalar()
        if not still:
            raise OwnershipLost(f"{task_id}: lease lapsed before commit")

    async def _task_type(self, task_id: uuid.UUID) -> tuple[str, int] | None:
        """(type, version): a row's type never changes, so this may be read before the write."""
        async with self._autocommit() as conn:
            row = (await run(conn, sql.TASK_TYPE_SQL, {"id": task_id})).first()
        return None if row is None else (row[0], row[1])

    async def attempt_outcome(self, token: uuid.UUID) -> str | None:
        """The task status an ended attempt wrote (None while it has not ended, or never committed).

        After a blink that ate a COMMIT's answer, a retried terminal write is refused: this tells
        whether the first one in fact committed."""
        async with self.engine.connect() as conn:
            row = (await run(conn, sql.ATTEMPT_OUTCOME_SQL, {"tok": token})).first()
        return None if row is None else str(row[0])

    async def release(
        self,
        task_id: uuid.UUID,
        token: uuid.UUID,
        *,
        outcome: str,
        delay: float,
        detail: str | None = None,
        message: str | None = None,
    ) -> bool:
        """Hand a retry-safe task back to pending (worker shutdown, a transient failure), to be
        claimed again after ``delay`` seconds; False if no longer owned. ``detail`` goes to the
        attempt record, ``message`` (why it waits) to the task."""
        try:
            async with self.owning_transaction(task_id, token) as (conn, row):
                await self._to_pending(
                    conn, row, outcome=outcome, delay=delay, detail=detail, message=message
                )
        except OwnershipLost:
            return False
        return True
