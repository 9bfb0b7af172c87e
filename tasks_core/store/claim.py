"""The claim: a pending task to running under a fresh token in a free capacity slot, or a typed
refusal; and the slot rows it needs."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy.exc import DBAPIError

from tasks_core.model import Status
from tasks_core.store import statements as sql
from tasks_core.store.base import StoreBase, runnable_arrays, type_caps
from tasks_core.store.execute import Row, run
from tasks_core.store.outcomes import Claim, ClaimRefusal, Refused, RunnableSource

# Refusals that mean the slot rows were changed behind the runtime's back, not that capacity is full.
_SLOTS_BROKEN = (ClaimRefusal.SLOTS_MISSING, ClaimRefusal.SLOTS_STALE)


class Claims(StoreBase):
    async def claim(
        self,
        task_id: uuid.UUID,
        registry: RunnableSource,
        *,
        capacity: int,
        lease_seconds: float,
        worker: str | None = None,
        lock_wait_seconds: float = 2.0,
        owner_max_running: int | None = None,
    ) -> Claim | Refused:
        """Atomically move a pending task to running under a fresh token; else the refusal.

        One statement takes a free capacity slot (SKIP LOCKED: claimers never wait on each other),
        marks the task running and records the attempt. Only where a per-type cap or a per-owner
        limit applies does the claim first take that type's / owner's lock, for at most
        ``lock_wait_seconds`` (``capacity_busy`` past it: the task is re-sent later).
        """
        caps = type_caps(registry)
        params = self._p(
            id=task_id,
            tok=uuid.uuid4(),
            lease=lease_seconds,
            worker=worker,
            cap=capacity,
            omax=owner_max_running,
            **runnable_arrays(registry),
            **caps,
        )
        for repaired in (False, True):
            await self._ensure_slots(capacity)
            try:
                claimed = None
                if not caps["ctypes"]:
                    # One statement, no lock: always without limits, and with a per-owner limit for a
                    # task that has no owner (omax 0 claims only those; the rest take the owner's lock).
                    fast = params if owner_max_running is None else {**params, "omax": 0}
                    claimed = next(iter(await self._fetch(sql.CLAIM_SQL, fast)), None)
                if claimed is None and (caps["ctypes"] or owner_max_running is not None):
                    claimed = await self._claim_under_locks(task_id, params, lock_wait_seconds)
            except DBAPIError as exc:
                if getattr(exc.orig, "sqlstate", None) != sql.LOCK_NOT_AVAILABLE:
                    raise
                await self.message_dropped(task_id)
                return Refused(ClaimRefusal.CAPACITY_BUSY)
            if claimed is not None:
                task = dict(claimed)
                return Claim(task=task, token=task["attempt_token"], attempt=task["attempt_count"])
            refused = await self._refusal(task_id, registry, capacity, owner_max_running)
            if refused.reason not in _SLOTS_BROKEN:
                return refused
            if not repaired:
                # Slot rows were removed, or left held, behind the runtime's back (a truncated or
                # hand-edited table): repair them once and claim again.
                self._slots = 0
                await self.free_orphan_slots()
        return Refused(ClaimRefusal.CAPACITY_FULL)

    async def _claim_under_locks(
        self, task_id: uuid.UUID, params: dict[str, Any], lock_wait_seconds: float
    ) -> Row | None:
        # Per-type and per-owner counts must be read after the lock that serialises their claimers
        # (a statement's snapshot is taken when it starts), so this path is a short transaction.
        async with self.engine.begin() as conn:
            row = (await run(conn, sql.CLAIM_TARGET_SQL, {"id": task_id})).first()
            if row is None:
                return None
            await run(conn, sql.LOCK_TIMEOUT_SQL, {"ms": f"{max(1, int(lock_wait_seconds * 1000))}ms"})
            if row[0] in params["ctypes"]:
                await run(conn, sql.ADVISORY_LOCK_SQL, {"k": f"dtask-type:{row[0]}"})
            if params["omax"] is not None and row[1] is not None:
                await run(conn, sql.ADVISORY_LOCK_SQL, {"k": f"dtask-owner:{row[1]}"})
            claimed = (await run(conn, sql.CLAIM_SQL, params)).mappings().first()
            return None if claimed is None else dict(claimed)

    async def free_orphan_slots(self) -> int:
        """Free capacity slots held for a task that no longer runs under that token (only a change
        made outside the runtime can leave one: every write that ends an attempt frees its slot)."""
        async with self._autocommit() as conn:
            return int((await run(conn, sql.FREE_ORPHAN_SLOTS_SQL)).rowcount)

    async def _ensure_slots(self, capacity: int) -> None:
        if capacity > self._slots:
            async with self._autocommit() as conn:
                await run(conn, sql.ENSURE_SLOTS_SQL, {"cap": capacity})
            self._slots = capacity

    async def message_dropped(self, task_id: uuid.UUID) -> None:
        """A message for this task was acknowledged without a claim: mark it for re-sending."""
        async with self._autocommit() as conn:
            await run(conn, sql.UNPUBLISH_SQL, {"id": task_id})

    async def _refusal(
        self, task_id: uuid.UUID, registry: RunnableSource, capacity: int, owner_max_running: int | None
    ) -> Refused:
        """Why a claim took nothing; a pending task without cancel intent is marked for re-sending
        (its message was dropped), in the same statement."""
        async with self._autocommit() as conn:
            row = (
                (await run(conn, sql.REFUSAL_SQL, self._p(id=task_id, omax=owner_max_running, cap=capacity)))
                .mappings()
                .first()
            )
        if row is None:
            return Refused(ClaimRefusal.UNKNOWN_TASK)
        if row["status"] != Status.PENDING:
            return Refused(ClaimRefusal.NOT_PENDING, Status(row["status"]))
        if registry.runnable(row["task_type"], row["handler_version"]) is None:
            return Refused(ClaimRefusal.NOT_RUNNABLE)
        if row["cancel"]:
            return Refused(ClaimRefusal.CANCEL_REQUESTED)
        if row["paused"]:
            return Refused(ClaimRefusal.TYPE_PAUSED)
        if row["backoff"]:
            return Refused(ClaimRefusal.BACKOFF)
        if row["owner_full"]:
            return Refused(ClaimRefusal.OWNER_LIMIT)
        if row["full"] and row["missing"] and self._slots:
            return Refused(ClaimRefusal.SLOTS_MISSING)
        if row["full"] and row["stale"]:
            return Refused(ClaimRefusal.SLOTS_STALE)
        return Refused(ClaimRefusal.CAPACITY_FULL)  # the cluster's, or the type's (TaskSpec.concurrency)
