"""The task object as users see it: the HTTP body of GET /tasks/{id} and `dtask show --json`."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

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
    "waiting_reason",
)


def _iso(value: datetime | None) -> str | None:
    # The same form the HTTP API serializes (UTC, "Z"), so `dtask show --json` matches it exactly.
    return None if value is None else value.astimezone(UTC).isoformat().replace("+00:00", "Z")


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
        "waiting_reason": waiting_reason,
    }
