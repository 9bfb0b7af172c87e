"""What a handler receives: its payload, fenced progress, the owning transaction, cancel checks."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from tasks_core import metrics
from tasks_core.repository import OwnershipLost, TaskRepository


class TaskCancelled(Exception):
    """Raised by ``raise_if_cancelled()`` once cancel intent has been seen."""


class TaskContext:
    def __init__(
        self,
        repo: TaskRepository,
        task: dict[str, Any],
        token: uuid.UUID,
        attempt: int,
        *,
        progress_delta: float = 1.0,
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

    @property
    def cancel_requested(self) -> bool:
        return self._cancel.is_set()

    def request_cancel(self) -> None:
        self._cancel.set()

    def raise_if_cancelled(self) -> None:
        """A control point: long handlers call it between steps to stop promptly and clean up."""
        if self._cancel.is_set():
            raise TaskCancelled(str(self.task_id))

    async def report(self, progress: float | None = None, message: str | None = None) -> None:
        """Persist progress (0-100) and/or a message as the live owner.

        Progress is throttled by numeric delta; a new message is always written. Raises
        OwnershipLost if the attempt no longer owns the task.
        """
        if progress is not None:
            progress = min(100.0, max(0.0, float(progress)))
        new_message = message is not None and message != self._message
        moved = progress is not None and (
            abs(progress - self._progress) >= self._delta or (progress == 100.0 != self._progress)
        )
        if not (new_message or moved):
            return
        if not await self._repo.report(
            self.task_id, self.attempt_token, progress if moved else None, message if new_message else None
        ):
            metrics.FENCED_WRITES_REJECTED.labels(write="report").inc()
            raise OwnershipLost(str(self.task_id))
        if moved and progress is not None:
            self._progress = progress
        if new_message:
            self._message = message

    @asynccontextmanager
    async def owning_transaction(self) -> AsyncIterator[AsyncConnection]:
        """A transaction that commits only if this attempt still owns the task at commit time."""
        body_raised = False
        try:
            async with self._repo.owning_transaction(self.task_id, self.attempt_token) as (conn, _row):
                try:
                    yield conn
                except BaseException:
                    body_raised = True
                    raise
        except OwnershipLost:
            # Refused on entry (not the owner) or at commit (lease lapsed): everything rolled back.
            # An OwnershipLost from inside the block was counted where it was raised.
            if not body_raised:
                metrics.FENCED_WRITES_REJECTED.labels(write="owning_transaction").inc()
            raise
