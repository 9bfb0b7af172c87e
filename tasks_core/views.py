"""The task object as users see it: the HTTP body of GET /tasks/{id} and `dtask show --json`."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from tasks_core.model import Status
from tasks_core.store.statements import WAITING_COUNT_CAP

if TYPE_CHECKING:
    from tasks_core.store.outcomes import WaitingFacts

FIELDS = (
    "id",
    "task_type",
    "handler_version",
    "status",
    "progress",
    "message",
    "result",
    "error",
    "attempt_count",
    "cancel_requested",
    "dedupe_key",
    "timeout_seconds",
    "created_at",
    "started_at",
    "finished_at",
    "lease_expires_at",
    "run_at",
    "priority",
    "retry_of",
    "retried_by",
    "waiting_reason",
)


def _iso(value: datetime | None) -> str | None:
    # The same form the HTTP API serializes (UTC, "Z"), so `dtask show --json` matches it exactly.
    return None if value is None else value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _id(value: Any) -> str | None:
    return None if value is None else str(value)


def scheduled_reason(run_at: datetime) -> str:
    return f"scheduled for {_iso(run_at)}"


def task_view(row: Mapping[str, Any], waiting_reason: str | None = None) -> dict[str, Any]:
    return {
        "id": str(row["id"]),
        "task_type": row["task_type"],
        "handler_version": row["handler_version"],
        "status": row["status"],
        "progress": row["progress"],
        "message": row["message"],
        "result": row["result"],
        "error": row["error"],
        "attempt_count": row["attempt_count"],
        "cancel_requested": row["cancel_requested_at"] is not None,
        "dedupe_key": row["dedupe_key"],
        "timeout_seconds": row["timeout_seconds"],
        "created_at": _iso(row["created_at"]),
        "started_at": _iso(row["started_at"]),
        "finished_at": _iso(row["finished_at"]),
        "lease_expires_at": _iso(row["lease_expires_at"]),
        "run_at": _iso(row["run_at"]),
        "priority": row["priority"],
        "retry_of": _id(row["retry_of"]),
        "retried_by": _id(row["retried_by"]),
        "waiting_reason": waiting_reason,
    }


def needs_waiting_facts(row: Mapping[str, Any]) -> bool:
    """Whether the reason a task waits needs the database's facts (the row alone tells the rest)."""
    return row["status"] == Status.PENDING and row["cancel_requested_at"] is None and not row["publish_error"]


def waiting_reason(
    row: Mapping[str, Any],
    facts: WaitingFacts | None,
    capacity: int,
    *,
    owner_max_running: int | None = None,
) -> str | None:
    """Why a pending task is not running yet, in words a user can act on; None unless pending.
    ``facts`` are needed when needs_waiting_facts(row)."""
    if row["status"] != Status.PENDING:
        return None
    if row["cancel_requested_at"] is not None:
        return "cancel requested"
    if row["publish_error"]:
        return f"publish failed: {row['publish_error']}"
    assert facts is not None, "a pending task's waiting reason needs its waiting facts"
    ahead = facts.ahead
    older = (
        f"more than {WAITING_COUNT_CAP:,} older tasks of yours"
        if ahead > WAITING_COUNT_CAP
        else f"{ahead} older task{'s' if ahead != 1 else ''} of yours"
    )
    behind = f", behind {older}" if ahead else ""
    if facts.paused:
        return "type paused"
    if facts.backoff:
        if row["attempt_count"] == 0 and row["run_at"] is not None:
            return scheduled_reason(row["run_at"])
        return f"retry backoff until {row['not_before'].isoformat()}"
    if owner_max_running is not None and facts.mine_running >= owner_max_running:
        return f"your running limit is reached ({facts.mine_running} of {owner_max_running})"
    if facts.running >= capacity:
        return f"capacity full ({facts.running} of {capacity} running){behind}"
    if row["last_published_at"] is None:
        # Capacity's worth of messages is already on the broker: this one is sent (by the
        # relay) as soon as a slot frees.
        return f"waiting for a free slot{behind}"
    if ahead:
        return f"behind {older}"
    return "waiting for a worker"
