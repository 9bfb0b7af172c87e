"""The API's rules for reading, cancelling and deleting one task, shared by /tasks and the dashboard.

Answers are the API's own: another owner's task does not exist for you (404), a finished task
cannot be cancelled and an active one cannot be deleted (409).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from fastapi import HTTPException

from app.auth import Principal
from tasks_core.model import ACTIVE, TERMINAL, Status
from tasks_core.services import Services
from tasks_core.submission import InvalidTask


async def owned_task(svc: Services, task_id: uuid.UUID, caller: Principal) -> dict[str, Any]:
    row = await svc.repo.get(task_id)
    if row is None or (not caller.admin and row["owner"] != caller.name):
        raise HTTPException(404, "no such task")  # another owner's task does not exist for you
    return dict(row)


async def cancel_task(svc: Services, task_id: uuid.UUID, caller: Principal) -> str:
    """'cancelled' (it was pending) or 'requested' (running: it stops at its next heartbeat)."""
    await owned_task(svc, task_id, caller)
    outcome = await svc.repo.request_cancel(task_id, svc.registry)
    if outcome is None:
        raise HTTPException(404, "no such task")
    if outcome == "terminal":
        raise HTTPException(409, "task already finished")
    return outcome


async def delete_task(svc: Services, task_id: uuid.UUID, caller: Principal) -> None:
    await owned_task(svc, task_id, caller)
    outcome = await svc.repo.delete(task_id)
    if outcome is None:
        raise HTTPException(404, "no such task")
    if outcome == "active":
        raise HTTPException(409, "only finished tasks can be deleted; cancel it first")


def invalid(exc: InvalidTask, prefix: tuple[Any, ...] = ("body",)) -> HTTPException:
    """A refused intent as the API answers it: the same shape as FastAPI's own validation errors,
    so clients handle one format (a payload model's field errors one by one, else one entry)."""
    errors = [{**e, "loc": [*prefix, *e["loc"]]} for e in exc.errors] or [
        {"loc": [*prefix, exc.field], "msg": exc.message, "type": "value_error"}
    ]
    return HTTPException(exc.status, errors)


def attempt_view(row: Mapping[str, Any], *, full: bool) -> dict[str, Any]:
    """An attempt as its task's owner sees it: the error in one line (its full text, a traceback,
    may name internal hosts, so only admin keys get it, as in the task's own ``error``)."""
    detail = row["detail"]
    if detail and not full:
        lines = detail.strip().splitlines() or [""]
        # A traceback's last line names the exception; any other detail leads with its reason.
        detail = (lines[-1] if lines[0].startswith("Traceback") else lines[0])[:300] or None
    return {
        "attempt": row["attempt"],
        "worker": row["worker"],
        "claimed_at": row["claimed_at"],
        "ended_at": row["ended_at"],
        "outcome": row["outcome"],
        "error": detail if row["outcome"] != "success" else None,
    }


def retryable(row: Mapping[str, Any]) -> bool:
    """Worth offering a retry: failed or cancelled, and not retried yet."""
    return row["status"] in (Status.FAILED, Status.CANCELLED) and row.get("retried_by") is None


def cancellable(row: Mapping[str, Any]) -> bool:
    """Worth offering a cancel: active, and nobody asked yet (asking again changes nothing)."""
    return row["status"] in ACTIVE and row["cancel_requested_at"] is None


def deletable(row: Mapping[str, Any]) -> bool:
    return row["status"] in TERMINAL
