"""Terminal hooks: converge the task's diagnostics_runs row in the task's terminal transaction."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from domains.diagnostics.model import diagnostics_runs


async def _converge(conn: AsyncConnection, task: Mapping[str, Any], row_status: str, hook: str) -> None:
    stmt = insert(diagnostics_runs).values(task_id=task["id"], status=row_status, hook=hook)
    # Only a row still in progress changes: a row already converged keeps its first verdict.
    await conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[diagnostics_runs.c.task_id],
            set_={"status": row_status, "hook": stmt.excluded.hook, "updated_at": stmt.excluded.updated_at},
            where=diagnostics_runs.c.status == "running",
        )
    )


async def on_success(conn: AsyncConnection, task: Mapping[str, Any], status: str) -> None:
    await _converge(conn, task, "done", f"success:{status}")


async def on_failure(conn: AsyncConnection, task: Mapping[str, Any], status: str) -> None:
    await _converge(conn, task, "cancelled" if status == "cancelled" else "failed", f"failure:{status}")
