"""Retry by hand: a failed or cancelled task is submitted again as a new task.

The new task has the old one's owner, type, payload, timeout, priority and dedupe key, runs the
type's current handler version, and names the old one (``retry_of``); the old one names it
(``retried_by``), set in the same transaction, so a task is retried at most once (a second retry,
a double click, answers with the first one's id). Every entry of a bulk retry commits in one
transaction, then the new tasks are published like any submission. A type whose tasks a domain
creates with its own rows (``TaskSpec.internal``) is retried through that domain (a reindex), not
here: a bare copy of its payload would find its rows owned by the old task.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from tasks_core.model import Status
from tasks_core.submission import MAX_BATCH, InvalidTask, Submitted, Submitter, TaskIntent, validate

RETRYABLE = (Status.FAILED, Status.CANCELLED)


class RetryRefused(InvalidTask):
    """This task cannot be retried: unknown (404), or not failed/cancelled, or retried already (409)."""

    def __init__(self, status: int, code: str, message: str, task_id: uuid.UUID | None = None) -> None:
        super().__init__("task_id", message)
        self.status, self.code, self.task_id = status, code, task_id


@dataclass(frozen=True)
class Retried:
    old: uuid.UUID
    new: Submitted


async def retry_tasks(
    submitter: Submitter, ids: Sequence[uuid.UUID], *, owner: str | None, admin: bool
) -> list[Retried | InvalidTask]:
    """Retry each task of ``ids`` (in order), as ``owner`` (None: an admin, any owner's task).
    Each entry gets its new task or why not; what was accepted commits together."""
    if len(ids) > MAX_BATCH:
        raise InvalidTask("ids", f"at most {MAX_BATCH} tasks per retry")
    services = submitter.services
    outcomes: list[Retried | InvalidTask] = []
    async with submitter.transaction(owner, admin=admin, public=True) as tx:
        rows = await services.repo.lock_for_retry(tx.conn, list(dict.fromkeys(ids)))
        for task_id in ids:
            row = rows.get(task_id)
            if row is None or (owner is not None and row["owner"] != owner):
                outcomes.append(RetryRefused(404, "not_found", "no such task"))
                continue
            if row["retried_by"] is not None:
                outcomes.append(RetryRefused(409, "retried", "already retried", task_id=row["retried_by"]))
                continue
            if row["status"] not in RETRYABLE:
                outcomes.append(
                    RetryRefused(
                        409,
                        "not_retryable",
                        f"only failed or cancelled tasks are retried, not {row['status']}",
                    )
                )
                continue
            intent = TaskIntent(
                row["task_type"], row["payload"], dedupe_key=row["dedupe_key"],
                timeout_seconds=min(row["timeout_seconds"], services.settings.max_timeout_seconds),
                priority=row["priority"],
            )  # fmt: skip
            try:
                new = validate(
                    intent, services.registry, services.settings, row["owner"], admin=admin, public=True
                )
                added = await tx.add_new(dataclasses.replace(new, retry_of=task_id))
            except InvalidTask as exc:
                outcomes.append(exc)
                continue
            if added.duplicate_of is not None:
                outcomes.append(
                    RetryRefused(
                        409, "duplicate", "an active task holds its dedupe key", task_id=added.duplicate_of
                    )
                )
                continue
            await services.repo.mark_retried(tx.conn, task_id, added.task_id)
            rows[task_id] = {**row, "retried_by": added.task_id}  # the same id twice: one retry
            outcomes.append(Retried(task_id, added))
    return outcomes
