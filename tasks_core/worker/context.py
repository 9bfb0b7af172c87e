"""What a handler receives: its payload, fenced progress, the owning transaction, cancel checks.

A database blink does not end an attempt: progress reports, and the start of an owning
transaction, are retried with short backoff for as long as the attempt's lease may still be valid
(``LeaseClock``). Only a fenced refusal or a passed deadline ends it (``OwnershipLost``). A failure
*inside* an owning transaction reaches the handler as ``DatabaseUnavailable`` (nothing of it was
committed); ``run_in_owning_transaction`` re-runs a whole transaction for handlers that want that.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection

from tasks_core import metrics
from tasks_core.db import is_transient
from tasks_core.store.facade import TaskStore
from tasks_core.store.outcomes import OwnershipLost
from tasks_core.worker.lease import DatabaseUnavailable, LeaseClock, retry_transient

T = TypeVar("T")

__all__ = ["DatabaseUnavailable", "OwnershipLost", "TaskCancelled", "TaskContext"]


def _lease_ran_out(task_id: uuid.UUID) -> OwnershipLost:
    return OwnershipLost(f"{task_id}: the lease ran out while the database was unreachable")


class TaskCancelled(Exception):
    """Raised by ``raise_if_cancelled()`` once cancel intent has been seen."""


class TaskContext:
    def __init__(
        self,
        repo: TaskStore,
        task: dict[str, Any],
        token: uuid.UUID,
        attempt: int,
        *,
        progress_delta: float = 1.0,
        lease: LeaseClock | None = None,
    ) -> None:
        self._repo = repo
        self.task_id: uuid.UUID = task["id"]
        self.task_type: str = task["task_type"]
        self.payload: dict[str, Any] = task["payload"]
        # Pass this downstream as the idempotency key of external side effects.
        self.attempt_token = token
        self.attempt = attempt
        self._delta = progress_delta
        self._progress: float = float(task.get("progress") or 0.0)
        self._message: str | None = task.get("message")
        self._cancel = asyncio.Event()
        # Without a lease clock (a context built by hand) nothing is retried.
        self.lease = lease or LeaseClock(0.0)

    @property
    def cancel_requested(self) -> bool:
        return self._cancel.is_set()

    def request_cancel(self) -> None:
        self._cancel.set()

    def raise_if_cancelled(self) -> None:
        """A control point: long handlers call it between steps to stop promptly and clean up."""
        if self._cancel.is_set():
            raise TaskCancelled(str(self.task_id))

    def _deadline(self) -> float:
        return self.lease.deadline

    async def report(self, progress: float | None = None, message: str | None = None) -> None:
        """Persist progress (0-100) and/or a message as the live owner.

        Progress is throttled by numeric delta; a new message is always written. Retried through a
        database blink while the lease may hold; raises OwnershipLost if the attempt no longer owns
        the task (or the database stayed away past the lease).
        """
        if progress is not None:
            progress = min(100.0, max(0.0, float(progress)))
        new_message = message is not None and message != self._message
        moved = progress is not None and (
            abs(progress - self._progress) >= self._delta or (progress == 100.0 != self._progress)
        )
        if not (new_message or moved):
            return
        try:
            owned = await retry_transient(
                lambda: self._repo.report(
                    self.task_id,
                    self.attempt_token,
                    progress if moved else None,
                    message if new_message else None,
                ),
                self._deadline,
                f"progress report of {self.task_id}",
            )
        except DatabaseUnavailable as exc:
            raise _lease_ran_out(self.task_id) from exc
        if not owned:
            metrics.FENCED_WRITES_REJECTED.labels(write="report").inc()
            raise OwnershipLost(str(self.task_id))
        if moved and progress is not None:
            self._progress = progress
        if new_message:
            self._message = message

    @asynccontextmanager
    async def owning_transaction(self) -> AsyncIterator[AsyncConnection]:
        """A transaction that commits only if this attempt still owns the task at commit time.

        Entering is retried through a database blink (no handler code has run yet). A transient
        failure inside the block or at commit raises DatabaseUnavailable: everything in the block
        was rolled back (or, if the connection broke during COMMIT, possibly committed — write
        idempotently, keyed by the attempt token).
        """
        opened: list[Any] = []

        async def enter() -> AsyncConnection:
            manager = self._repo.owning_transaction(self.task_id, self.attempt_token)
            conn, _row = await manager.__aenter__()
            opened.append(manager)
            return conn

        try:
            conn = await retry_transient(enter, self._deadline, f"owning transaction of {self.task_id}")
        except DatabaseUnavailable as exc:
            raise _lease_ran_out(self.task_id) from exc
        except OwnershipLost:
            metrics.FENCED_WRITES_REJECTED.labels(write="owning_transaction").inc()
            raise
        manager = opened[-1]
        try:
            yield conn
        except BaseException as exc:
            # The block failed: roll back (the manager re-raises what it was given, or its own).
            try:
                await manager.__aexit__(type(exc), exc, exc.__traceback__)
            except Exception as rollback_exc:
                if rollback_exc is not exc and is_transient(rollback_exc):
                    raise DatabaseUnavailable(str(self.task_id)) from exc
                raise
            if is_transient(exc):
                raise DatabaseUnavailable(f"owning transaction of {self.task_id}") from exc
            raise
        try:
            await manager.__aexit__(None, None, None)  # lease re-check, then COMMIT
        except OwnershipLost:
            metrics.FENCED_WRITES_REJECTED.labels(write="owning_transaction").inc()
            raise
        except Exception as exc:
            if is_transient(exc):
                raise DatabaseUnavailable(f"commit of {self.task_id}'s owning transaction") from exc
            raise

    async def run_in_owning_transaction(self, write: Callable[[AsyncConnection], Awaitable[T]]) -> T:
        """Run ``write(conn)`` in an owning transaction, re-running the whole transaction from the
        start after a database blink, while the lease may still hold. ``write`` must be safe to run
        again (it is: a failed run committed nothing, unless the connection broke during COMMIT —
        so key its rows by something stable)."""

        async def once() -> T:
            try:
                async with self.owning_transaction() as conn:
                    return await write(conn)
            except DatabaseUnavailable as exc:
                # Unwrap so retry_transient sees the transient cause and tries again.
                raise exc.__cause__ or exc from None

        try:
            return await retry_transient(once, self._deadline, f"owning transaction of {self.task_id}")
        except DatabaseUnavailable as exc:
            raise _lease_ran_out(self.task_id) from exc
