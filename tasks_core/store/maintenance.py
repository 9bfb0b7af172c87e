"""Convergence and clean-up by someone other than the owner: the reconciler's pass, cancel,
delete, prune, and the sessions and slots a stopped process left behind."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from tasks_core.model import LEGACY_VERSION, Status
from tasks_core.store import statements as sql
from tasks_core.store.claim import Claims
from tasks_core.store.execute import Row, plain_uuid, run
from tasks_core.store.outcomes import HookSource, ReconcileReport, RunnableSource
from tasks_core.store.transitions import Transitions

log = logging.getLogger(__name__)

# Why a pre-durable task that was pending or running ends failed (`legacy_interrupted`).
INTERRUPTED_MESSAGE = "interrupted by the upgrade from the pre-durable release; resubmit to run it again"


class Maintenance(Transitions, Claims):
    async def request_cancel(self, task_id: uuid.UUID, hooks: HookSource | None) -> str | None:
        """Cancel a task: 'cancelled' (pending, at once, with its failure hook), 'requested'
        (running: the owner stops at its next heartbeat or control point), 'terminal', or None."""
        async with self.engine.begin() as conn:
            row = (await run(conn, sql.LOCK_TASK_SQL, {"id": task_id})).mappings().first()
            if row is None:
                return None
            if row["status"] == Status.PENDING:
                await self._converge(
                    conn,
                    dict(row),
                    Status.CANCELLED,
                    {"code": "cancelled", "message": "cancelled before start"},
                    hooks,
                )
                await run(conn, sql.CANCEL_PENDING_SQL, self._p(id=task_id))
                return "cancelled"
            if row["status"] == Status.RUNNING:
                await run(conn, sql.CANCEL_RUNNING_SQL, self._p(id=task_id))
                return "requested"
            return "terminal"

    async def delete(self, task_id: uuid.UUID) -> str | None:
        """Delete a terminal task: 'deleted', 'active' (refused), or None for an unknown id."""
        async with self.engine.begin() as conn:
            status = (await run(conn, sql.LOCK_STATUS_SQL, {"id": task_id})).scalar()
            if status is None:
                return None
            if status not in (Status.SUCCESS, Status.FAILED, Status.CANCELLED):
                return "active"
            await run(conn, sql.DELETE_SQL, {"id": task_id})
            return "deleted"

    async def prune(self, older_than_seconds: float, batch: int = 5000) -> int:
        """Delete terminal tasks finished longer ago than the given age, in bounded batches."""
        total = 0
        while True:
            async with self.engine.begin() as conn:
                n = (
                    await run(conn, sql.PRUNE_SQL, self._p(age=older_than_seconds, batch=batch))
                ).rowcount
            total += n
            if n < batch:
                return total

    async def prune_idempotency_keys(self, batch: int = 1000) -> int:
        """Forget Idempotency-Keys older than their time to live (bounded batch)."""
        async with self.engine.begin() as conn:
            return (
                await run(
                    conn,
                    sql.PRUNE_IDEMPOTENCY_KEYS_SQL,
                    self._p(ttl=sql.IDEMPOTENCY_TTL_SECONDS, batch=batch),
                )
            ).rowcount

    async def end_stalled_sessions(self, older_than_seconds: float) -> int:
        """End worker sessions whose transaction has been open longer than ``older_than_seconds``.

        No transaction of a worker outlives a lease legitimately (an owning transaction that long
        rolls back at commit anyway). A worker stopped mid-transaction would hold its task's row
        lock, and the reconciler (SKIP LOCKED) would never converge that task. PostgreSQL ends an
        idle-in-transaction session after a lease by itself, but not one stopped between a
        statement's Parse and its Sync (asyncpg prepares statements that way), and
        transaction_timeout only exists from PostgreSQL 17: so the reconciler ends them here.
        """
        async with self._autocommit() as conn:
            ended = (
                (await run(conn, sql.END_STALLED_SESSIONS_SQL, self._p(age=older_than_seconds)))
                .scalars()
                .all()
            )
        if ended:
            log.warning("ended %d worker session(s) stuck in a transaction", len(ended))
        return sum(1 for e in ended if e)

    async def running_attempts_of(self, node: str) -> list[tuple[str, uuid.UUID]]:
        """(worker, token) of every running attempt claimed by a process of worker node ``node``."""
        async with self._autocommit() as conn:
            rows = await run(conn, sql.RUNNING_ATTEMPTS_OF_SQL, {"prefix": f"{node}:"})
            return [(str(worker), plain_uuid(token)) for worker, token in rows]

    async def expire_attempts(self, tokens: Sequence[uuid.UUID]) -> list[uuid.UUID]:
        """End the leases of these attempts now (their process is dead); the ids of the tasks whose
        lease this ended. The reconciler converges them on its next pass."""
        if not tokens:
            return []
        async with self._autocommit() as conn:
            rows = await run(conn, sql.EXPIRE_ATTEMPTS_SQL, self._p(toks=list(tokens)))
            return [plain_uuid(task_id) for (task_id,) in rows]

    async def reconcile(
        self,
        registry: RunnableSource,
        *,
        batch: int,
        retry_delay: Any,
        stalled_after: float | None = None,
    ) -> ReconcileReport:
        """Converge expired leases, legacy (v0) rows, expired rows nobody can run, and pending rows
        that carry cancel intent (claim and publisher skip those, so only this finishes them).

        One transaction per task; rows locked elsewhere are skipped (SKIP LOCKED) so two
        reconcilers never fight; a task whose convergence fails is skipped for the rest of the run.
        """
        report = ReconcileReport()
        if stalled_after is not None:
            report.sessions_ended = await self.end_stalled_sessions(stalled_after)
        report.slots_freed = await self.free_orphan_slots()
        skip: list[uuid.UUID] = []
        for _ in range(batch):
            async with self.engine.begin() as conn:
                row = (await run(conn, sql.NEXT_TO_RECONCILE_SQL, self._p(skip=skip))).mappings().first()
                if row is None:
                    break
                try:
                    async with conn.begin_nested():
                        await self._reconcile_one(conn, dict(row), registry, report, retry_delay)
                except Exception as exc:  # one bad task never blocks the rest
                    log.exception("reconciling task %s failed", row["id"])
                    report.errors.append(f"{row['id']}: {exc!r}")
                    skip.append(row["id"])
        return report

    async def _reconcile_one(
        self,
        conn: AsyncConnection,
        row: Row,
        registry: RunnableSource,
        report: ReconcileReport,
        retry_delay: Any,
    ) -> None:
        version = row["handler_version"]
        cancel = row["cancel_requested_at"] is not None
        if version == LEGACY_VERSION:
            ok = await self._converge_legacy(conn, row, registry)
            report.legacy += 1
        elif row["status"] == Status.PENDING:
            # Pending with cancel intent (e.g. a retry-safe task handed back at worker shutdown just
            # after cancel was requested): claims refuse it and the publisher skips it, so without
            # this it would stay pending forever. The hook source only serves runnable versions.
            ok = await self._converge(
                conn,
                row,
                Status.CANCELLED,
                {"code": "cancelled", "message": "cancel requested while pending"},
                registry,
            )
            report.cancelled += 1
        else:
            spec = registry.runnable(row["task_type"], version)
            if spec is None:
                ok = await self._converge(
                    conn,
                    row,
                    Status.FAILED,
                    {
                        "code": "handler_unavailable",
                        "message": f"no handler for {row['task_type']} version {version}",
                    },
                    None,
                )
                report.unrunnable += 1
            elif spec.retry_safe and row["attempt_count"] < spec.max_attempts and not cancel:
                await self._to_pending(
                    conn, row, outcome="lease_expired", delay=retry_delay(row["attempt_count"])
                )
                report.retried += 1
                return
            else:
                status = Status.CANCELLED if row["cancel_requested_at"] else Status.FAILED
                ok = await self._converge(
                    conn,
                    row,
                    status,
                    {"code": "lease_expired", "message": "the owner stopped renewing its lease"},
                    registry,
                )
                report.failed += 1
        if not ok:
            report.hook_errors += 1

    async def _converge_legacy(self, conn: AsyncConnection, row: Row, registry: RunnableSource) -> bool:
        """A non-terminal task of the pre-durable release: whatever ran it died with the old process.

        Its cancel intent is honoured (``cancelled``), otherwise it ends ``failed``
        (``legacy_interrupted``), both through the current type's failure hook; a type this
        deployment no longer has fails closed, without any hook.
        """
        cancel = row["cancel_requested_at"] is not None
        if row["task_type"] not in registry:
            status = Status.CANCELLED if cancel else Status.FAILED
            message = f"no handler for {row['task_type']} (a task of the pre-durable release)"
            error = {"code": "handler_unavailable", "message": message}
            return await self._converge(conn, row, status, error, None)
        if cancel:
            status = Status.CANCELLED
            error = {"code": "cancelled", "message": "cancel requested before the upgrade"}
        else:
            status = Status.FAILED
            error = {"code": "legacy_interrupted", "message": INTERRUPTED_MESSAGE}
        return await self._converge(conn, row, status, error, registry)

    async def legacy_backlog(self) -> dict[str, int]:
        """Tasks of the pre-durable release still waiting for the reconciler, by status."""
        async with self.engine.connect() as conn:
            rows = await run(conn, sql.LEGACY_BACKLOG_SQL)
            return {status: int(n) for status, n in rows}

    async def fail_unrunnable_pending(self, registry: RunnableSource, *, batch: int) -> int:
        """Fail closed pending (non-legacy) tasks whose type or version this deployment cannot run."""
        pairs = [(s.task_type, s.version) for s in registry.specs()]  # type: ignore[attr-defined]
        n = 0
        async with self.engine.begin() as conn:
            rows = (
                (
                    await run(
                        conn,
                        sql.UNRUNNABLE_PENDING_SQL,
                        {"types": [p[0] for p in pairs], "versions": [p[1] for p in pairs], "batch": batch},
                    )
                )
                .mappings()
                .all()
            )
            for row in rows:
                await self._converge(
                    conn,
                    dict(row),
                    Status.FAILED,
                    {
                        "code": "handler_unavailable",
                        "message": f"no handler for {row['task_type']} version {row['handler_version']}",
                    },
                    None,
                )
                n += 1
        return n
