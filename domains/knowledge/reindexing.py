"""Handing files to a new ``knowledge.reindex`` task: one file, or every file of a base that waits.

The routes, the dashboard and the verifier's repair all reindex through here. A file is assigned
to its new task (status ``uploaded``) in the transaction that creates the task, so it is never
claimed by two tasks, and a dedupe key per file and per base keeps one reindex active at a time.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from domains.knowledge import catalog
from domains.knowledge.tasks import REINDEX
from tasks_core.services import Services
from tasks_core.submission import Submitter, TaskIntent


@dataclass(frozen=True)
class FileReindex:
    task_id: uuid.UUID | None  # the new task; None when one is active (``conflict`` says which)
    filename: str = ""
    # why not: the file's task is active, a reindex of it is, or it was refused at upload (no
    # original to parse)
    conflict: str | None = None
    active: uuid.UUID | None = None  # that active task


async def reindex_file(svc: Services, file_id: str, owner: str) -> FileReindex | None:
    """A new task for the file (None if there is no such file). Raises InvalidTask when the
    owner's quota refuses it."""
    async with Submitter(svc).transaction(owner=owner) as tx:
        row = await catalog.get_file(tx.conn, file_id, lock=True)
        if row is None:
            return None
        if row["task_active"]:
            active = "the file's task is still active; cancel it or wait"
            return FileReindex(None, row["filename"], active, row["task_id"])
        if catalog.refused_at_upload(row):
            refused = f"{row['filename']} was refused at upload ({row['error_message']}); delete it"
            return FileReindex(None, row["filename"], refused)
        submitted = await tx.add(TaskIntent(REINDEX, {"file_id": file_id}, dedupe_key=f"file:{file_id}"))
        if submitted.duplicate_of is not None:
            duplicate = "a reindex of this file is already active"
            return FileReindex(None, row["filename"], duplicate, submitted.duplicate_of)
        await catalog.assign(tx.conn, [file_id], submitted.task_id)
    return FileReindex(submitted.task_id, row["filename"])


class _NothingToDo(Exception):
    pass


@dataclass(frozen=True)
class BaseReindex:
    task_id: uuid.UUID | None  # None: no file needed it, or one is already active
    files: list[dict[str, Any]]  # the files handed to the new task
    active: uuid.UUID | None = None  # the reindex of this base that is already active


async def reindex_base(svc: Services, base_id: str, owner: str) -> BaseReindex:
    """One task for every errored (or stranded uploaded) file of the base; one at a time per base.
    Raises InvalidTask when the owner's quota refuses it."""
    try:
        async with Submitter(svc).transaction(owner=owner) as tx:
            submitted = await tx.add(TaskIntent(REINDEX, {"base_id": base_id}, dedupe_key=f"base:{base_id}"))
            if submitted.duplicate_of is not None:
                return BaseReindex(None, [], submitted.duplicate_of)
            file_ids = await catalog.reindexable(tx.conn, base_id)
            if not file_ids:
                raise _NothingToDo  # roll the task back: nothing would run
            await catalog.assign(tx.conn, file_ids, submitted.task_id)
            rows = [await catalog.get_file(tx.conn, fid) for fid in file_ids]
    except _NothingToDo:
        return BaseReindex(None, [])
    return BaseReindex(submitted.task_id, [r for r in rows if r])
