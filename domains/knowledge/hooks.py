"""Terminal hooks: inside the task's terminal transaction, files it still holds in progress converge.

A file left ``uploaded`` or ``parsing`` becomes ``error_parsing``, one left ``parsed`` or
``indexing`` becomes ``error_indexing``, with the task's error as the message; so no file stays in
progress once its task is terminal (I6), whichever way the task ended (failure, timeout, cancel,
lease expiry found by the reconciler, worker shutdown).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from domains.knowledge import catalog


async def _reason(conn: AsyncConnection, task: Mapping[str, Any], status: str) -> str:
    # The terminal update ran earlier in this transaction: the row already carries its error.
    error = (await conn.execute(text("SELECT error FROM tasks WHERE id = :id"), {"id": task["id"]})).scalar()
    if isinstance(error, dict) and error.get("code"):
        return f"task {task['id']} {status} ({error['code']}: {error.get('message', '')}); reindex to retry"
    return f"task {task['id']} ended {status}; reindex to retry"


async def on_failure(conn: AsyncConnection, task: Mapping[str, Any], status: str) -> None:
    await catalog.converge(conn, task["id"], await _reason(conn, task, status))


async def on_success(conn: AsyncConnection, task: Mapping[str, Any], status: str) -> None:
    # A handler that returned normally has finished every file it held; this only guards I6.
    await catalog.converge(conn, task["id"], f"task {task['id']} finished without completing this file")
