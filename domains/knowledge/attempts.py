"""Which attempt of its task a file in progress is on: the API's file views and the dashboard's
file rows show the same (from a file row joined with its task, as the catalog reads them)."""

from __future__ import annotations

from typing import Any

from domains.knowledge.model import IN_PROGRESS
from tasks_core.registry import Registry


def attempt_of(row: dict[str, Any], registry: Registry) -> tuple[int, int] | None:
    """(attempt, max_attempts) of the task working on a file in progress: the attempt running it,
    or while the task waits (for its first claim, or its backoff after a lost attempt) the next
    one. None when no task is working on it."""
    if row["status"] not in IN_PROGRESS or row.get("task_status") not in ("pending", "running"):
        return None
    attempts = int(row["task_attempts"] or 0)
    current = attempts if row["task_status"] == "running" else attempts + 1
    spec = registry.get(row["task_type"])
    return current, spec.max_attempts if spec is not None else current
