"""Terminal hooks, inside the task's terminal transaction: a build never outlives its task (I6).

Success makes the build the base's graph in the same transaction as the task's success (and drops
the older finished builds); any other end marks it ``failed`` or ``cancelled`` with the task's
error and deletes its partial counts, so readers only ever see a whole graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from domains.graph import store
from domains.graph.model import CANCELLED, FAILED


async def _reason(conn: AsyncConnection, task: Mapping[str, Any], status: str) -> str:
    # The terminal update ran earlier in this transaction: the row already carries its error.
    error = (await conn.execute(text("SELECT error FROM tasks WHERE id = :id"), {"id": task["id"]})).scalar()
    if isinstance(error, dict) and error.get("code"):
        return f"task {task['id']} {status} ({error['code']}: {error.get('message', '')}); build again"
    return f"task {task['id']} ended {status}; build again"


async def on_success(conn: AsyncConnection, task: Mapping[str, Any], status: str) -> None:
    await store.finish(conn, task["id"])


async def on_failure(conn: AsyncConnection, task: Mapping[str, Any], status: str) -> None:
    ended = CANCELLED if status == "cancelled" else FAILED
    await store.fail(conn, task["id"], ended, await _reason(conn, task, status))
