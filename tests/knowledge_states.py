"""Knowledge files brought into each of their states the way workers move them, without Milvus or
S3: a real ingest task, a real claim, the catalog's owned transitions, the task's terminal hook.
For the dashboard tests (integration and browser), which show these states."""

from __future__ import annotations

import uuid
from typing import Any

from domains.knowledge import catalog
from domains.knowledge.hashing import HashingEmbedder
from domains.knowledge.parsing import file_type_of
from domains.knowledge.tasks import INGEST
from tasks_core.model import Status
from tasks_core.store.outcomes import Claim, NewTask


async def new_base(svc: Any, owner: str, name: str) -> str:
    async with svc.engine.begin() as conn:
        return str((await catalog.insert_base(conn, owner, name, HashingEmbedder().name, 1024))["id"])


async def add_file(svc: Any, base_id: str, owner: str, filename: str) -> tuple[str, uuid.UUID]:
    """A file as an upload leaves it: ``uploaded``, owned by its pending ingest task."""
    file_id = catalog.new_id()
    task = NewTask(INGEST, 1, {"file_id": file_id}, timeout_seconds=3600, owner=owner)
    row = {
        "file_id": file_id,
        "kb_id": base_id,
        "filename": filename,
        "file_type": file_type_of(filename) or "txt",
        "size_bytes": 1234,
    }
    async with svc.engine.begin() as conn:
        task_id: uuid.UUID = (await svc.repo.insert(conn, task)).id
        await catalog.insert_files(conn, [{**row, "task_id": task_id}])
    return file_id, task_id


async def parse(svc: Any, file_id: str, task_id: uuid.UUID) -> uuid.UUID:
    """A worker claims the file's task and starts parsing it (``parsing``)."""
    got = await svc.repo.claim(task_id, svc.registry, capacity=100, lease_seconds=60.0, worker="test")
    assert isinstance(got, Claim), got
    async with svc.engine.begin() as conn:
        assert await catalog.start(conn, file_id, task_id, got.token)
    return got.token


async def index(
    svc: Any, file_id: str, task_id: uuid.UUID, chunks: int, token: uuid.UUID | None = None
) -> None:
    """Parsed (by the attempt ``token`` that is parsing it, else a new claim), indexed with
    ``chunks`` chunks, and the task succeeds (``indexed``)."""
    token = token or await parse(svc, file_id, task_id)
    async with svc.engine.begin() as conn:
        for expect, to, values in (
            ("parsing", "parsed", {}),
            ("parsed", "indexing", {}),
            ("indexing", "indexed", {"chunk_count": chunks}),
        ):
            assert await catalog.advance(conn, file_id, task_id, token, expect, to, **values)
    await svc.repo.finish(task_id, token, svc.registry, status=Status.SUCCESS, result={"chunks": chunks})


async def break_(svc: Any, file_id: str, task_id: uuid.UUID, message: str) -> None:
    """The task fails while parsing: its terminal hook leaves the file ``error_parsing``."""
    token = await parse(svc, file_id, task_id)
    error = {"code": "handler_error", "message": message}
    await svc.repo.finish(task_id, token, svc.registry, status=Status.FAILED, error=error)
