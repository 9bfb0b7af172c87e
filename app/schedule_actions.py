"""The API's rules for one schedule, shared by /schedules and the dashboard.

A key sees its own schedules only (another owner's does not exist for it: 404); an admin key sees
every owner's, and names the owner (``owner``) when two owners use the same name (409 otherwise).
"""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException

from app.auth import Principal
from tasks_core.schedule_rules import Rule
from tasks_core.schedules import NAME
from tasks_core.services import Services
from tasks_core.store.schedules import ScheduleStore

# A schedule's page and GET /schedules/{name} show this many next slots and last tasks.
UPCOMING = 5
LAST_TASKS = 10


async def owned_schedule(
    svc: Services, name: str, caller: Principal, owner: str | None = None
) -> dict[str, Any]:
    if not NAME.fullmatch(name):
        raise HTTPException(404, "no such schedule")
    # A plain key looks among its own; an admin among everyone's, or the owner it names.
    scope = caller.name if not caller.admin else owner
    rows = await ScheduleStore.of(svc).find(name, scope)
    if not rows:
        raise HTTPException(404, "no such schedule")
    if len(rows) > 1:
        owners = ", ".join(r["owner"] for r in rows[:10])
        raise HTTPException(409, f"several owners have a schedule named {name!r} ({owners}): pass ?owner=")
    return rows[0]


def schedule_view(row: dict[str, Any]) -> dict[str, Any]:
    """The schedule object of the API (list entries)."""
    paused = row["paused_at"] is not None
    return {
        "name": row["name"],
        "owner": row["owner"],
        "task_type": row["task_type"],
        "payload": row["payload"],
        "cron": row["cron"],
        "every_seconds": row["every_seconds"],
        "timezone": row["timezone"] if row["cron"] is not None else None,
        "priority": row["priority"],
        "paused": paused,
        "paused_at": row["paused_at"],
        # While paused there is no next slot: resuming picks the first one after that moment.
        "next_run_at": None if paused else row["next_run_at"],
        "created_at": row["created_at"],
        "last_fired_at": row["last_fired_at"],
        "last_error": row["last_error"],
    }


async def schedule_detail(svc: Services, row: dict[str, Any]) -> dict[str, Any]:
    """The schedule with its next slots and the last tasks it created (newest first)."""
    view = schedule_view(row)
    upcoming = [] if view["paused"] else Rule.of_row(row).upcoming(row["next_run_at"], UPCOMING)
    runs = await ScheduleStore.of(svc).runs(row["id"], LAST_TASKS)
    last = [{"task_id": r["task_id"], "slot_at": r["slot_at"], "status": r["status"]} for r in runs]
    return {**view, "upcoming": upcoming, "last_tasks": last}
