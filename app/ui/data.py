"""What the dashboard reads, through the repository: one page of tasks, one task, its attempts.

Ages and lease times are measured against PostgreSQL's clock, the one that decides leases: the
api's own clock may be off, and "lease left" must mean what the reconciler will see.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from fastapi import Request

from app.cache import TtlCache
from app.task_actions import cancellable, deletable, retryable
from app.ui.session import UiError
from tasks_core.db import db_now
from tasks_core.model import Status
from tasks_core.services import Services
from tasks_core.views import task_view

STATUSES = tuple(s.value for s in Status)
PAGE_SIZES = (25, 50, 100, 200)
DEFAULT_PAGE_SIZE = 50


def page_size(limit: int) -> int:
    """One of the offered page sizes (anything else asked for gets the default)."""
    return limit if limit in PAGE_SIZES else DEFAULT_PAGE_SIZE


@dataclass(frozen=True)
class StatusPage:
    """A keyset page of a domain's newest-first list, optionally of one status."""

    status: str | None = None
    cursor: str | None = None
    limit: int = DEFAULT_PAGE_SIZE

    def query(self, **changes: Any) -> str:
        """This view's query string, with ``changes`` (e.g. another cursor) applied."""
        f = replace(self, **changes)
        params = {"status": f.status, "cursor": f.cursor}
        params["limit"] = None if f.limit == DEFAULT_PAGE_SIZE else str(f.limit)
        return urlencode({k: v for k, v in params.items() if v})


def status_page(
    statuses: Sequence[str], status: str, cursor: str, limit: int, *, noun: str = ""
) -> StatusPage:
    """The page asked for, or 400 naming what was wrong (``noun``: what the list holds)."""
    if status and status not in statuses:
        raise UiError(400, f"Unknown {noun + ' ' if noun else ''}status.")
    if not re.fullmatch(r"[A-Za-z0-9_-]*", cursor):
        raise UiError(
            400,
            f"That page link is not valid; start again from the newest{' ' + noun + 's' if noun else ''}.",
        )
    return StatusPage(status or None, cursor or None, page_size(limit))


def services(request: Request) -> Services:
    svc: Services = request.app.state.services
    return svc


@dataclass(frozen=True)
class Filters:
    status: str | None = None
    task_type: str | None = None
    cursor: str | None = None
    limit: int = DEFAULT_PAGE_SIZE

    def query(self, **changes: Any) -> str:
        """This view's query string, with ``changes`` (e.g. another cursor) applied."""
        f = replace(self, **changes)
        params = {"status": f.status, "task_type": f.task_type, "cursor": f.cursor}
        params["limit"] = None if f.limit == DEFAULT_PAGE_SIZE else str(f.limit)
        return urlencode({k: v for k, v in params.items() if v})


async def summary(request: Request, owner: str | None) -> tuple[dict[str, Any], float]:
    """Counts by status and type, and their age: from the cache GET /tasks/summary answers from,
    so a room full of dashboards costs one count per key and interval."""
    svc: Services = request.app.state.services
    cache: TtlCache[dict[str, Any]] = request.app.state.summary_cache
    return await cache.get(owner, lambda: svc.repo.summary(owner=owner))


async def waiting_reason(svc: Services, row: Mapping[str, Any]) -> str | None:
    return await svc.repo.waiting_reason(
        row, svc.settings.capacity, owner_max_running=svc.settings.owner_running_limit
    )


def _seconds(delta: timedelta) -> float:
    return delta.total_seconds()


def describe(row: Mapping[str, Any], now: datetime, reason: str | None = None) -> dict[str, Any]:
    """The API's task object plus what a person reads off a row: owner, age, lease left, actions."""
    lease = row["lease_expires_at"]
    return {
        **task_view(row, reason),
        "owner": row["owner"],
        "age": (now - row["created_at"]).total_seconds(),
        "lease_left": (lease - now).total_seconds() if lease and row["status"] == Status.RUNNING else None,
        "ran_for": ((row["finished_at"] or now) - row["started_at"]).total_seconds()
        if row["started_at"]
        else None,
        "at": {k: row[f"{k}_at"] for k in ("created", "started", "finished", "heartbeat")},
        "cancellable": cancellable(row),
        "deletable": deletable(row),
        "retryable": retryable(row),
    }


async def task_page(
    svc: Services, filters: Filters, owner: str | None
) -> tuple[list[dict[str, Any]], str | None]:
    """One keyset page (never more rows than the page size) and the cursor of the next one."""
    rows, next_cursor = await svc.repo.list(
        status=filters.status,
        task_type=filters.task_type,
        owner=owner,
        limit=filters.limit,
        cursor=filters.cursor,
    )
    now = await db_now(svc.engine)
    return [describe(row, now, await waiting_reason(svc, row)) for row in rows], next_cursor


async def attempts(svc: Services, task_id: uuid.UUID, *, admin: bool) -> list[dict[str, Any]]:
    """Every claim of the task. ``detail`` (the full error text and traceback) is for operators:
    owners see the error's class and first line on the task itself."""
    found = []
    for row in await svc.repo.attempts(task_id):
        ended, claimed = row["ended_at"], row["claimed_at"]
        found.append(
            {
                **row,
                "detail": row.get("detail") if admin else None,
                "took": (ended - claimed).total_seconds() if ended else None,
            }
        )
    return found
