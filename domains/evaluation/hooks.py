"""Terminal hooks: inside the task's terminal transaction, the dataset or run it holds converges.

Success completes it (a dataset only with exactly its target of items; a run with its metrics), so
completion and the task's success commit together or not at all; an attempt whose lease ran out
cannot finish its task and so cannot complete anything. Failure, timeout, worker shutdown and lease
expiry found by the reconciler end it ``failed``, a cancel ``cancelled``; items and outcomes
already committed stay (I6).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from domains.evaluation import store
from domains.evaluation.model import CANCELLED, FAILED


async def _reason(conn: AsyncConnection, task: Mapping[str, Any], status: str, advice: str) -> str:
    # The terminal update ran earlier in this transaction: the row already carries its error.
    error = (await conn.execute(text("SELECT error FROM tasks WHERE id = :id"), {"id": task["id"]})).scalar()
    if isinstance(error, dict) and error.get("code"):
        return f"task {task['id']} {status} ({error['code']}: {error.get('message', '')}){advice}"
    return f"task {task['id']} ended {status}{advice}"


def _status(status: str) -> str:
    return CANCELLED if status == "cancelled" else FAILED


async def dataset_success(conn: AsyncConnection, task: Mapping[str, Any], status: str) -> None:
    await store.complete_dataset(conn, task["id"])


async def dataset_failure(conn: AsyncConnection, task: Mapping[str, Any], status: str) -> None:
    reason = await _reason(conn, task, status, "; resume to continue from the items kept")
    await store.end_dataset(conn, task["id"], _status(status), reason)


async def run_success(conn: AsyncConnection, task: Mapping[str, Any], status: str) -> None:
    await store.complete_run(conn, task["id"])


async def run_failure(conn: AsyncConnection, task: Mapping[str, Any], status: str) -> None:
    await store.end_run(conn, task["id"], _status(status), await _reason(conn, task, status, ""))
