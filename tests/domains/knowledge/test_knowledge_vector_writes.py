"""How an ingest writes a file's vectors: an upload's first attempt inserts them (no chunk id of a new
file can have a vector yet, and milvus-lite's upsert reads every id's old row across the collection
first); a retried attempt and a reindex upsert, so whatever an earlier attempt wrote is overwritten.
On the real Milvus and database; the Milvus client is the real one, its writes recorded (and one
answer lost, as a dropped connection would lose it)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

from domains.knowledge.handlers import index_file
from domains.knowledge.model import INDEXED, INDEXING
from domains.knowledge.stores import stores_for
from tasks_core.retry import RetryableError
from tasks_core.settings import Settings
from tasks_core.worker.context import TaskContext
from tests.knowledge_helpers import (
    ALICE,
    create_base,
    file_row,
    knowledge_api,
    lapse_and_reconcile,
    milvus_client,
    run_pending,
    scalar,
    upload,
    vector_count,
)

pytestmark = pytest.mark.usefixtures("clean_db")
TEXT = b"some words here. " * 200  # a few chunks
WRITES = ("insert", "upsert", "delete")


class Recording:
    """The real MilvusClient; its writes named in ``writes``. With ``lose_answer_to``, the first
    such call is made, then fails as if the connection dropped before its answer came back."""

    def __init__(self, real: Any, lose_answer_to: str | None = None) -> None:
        self._real = real
        self.writes: list[str] = []
        self._lose = lose_answer_to

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._real, name)
        if name not in WRITES:
            return method

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.writes.append(name)
            result = method(*args, **kwargs)
            if name == self._lose:
                self._lose = None
                raise ConnectionError("connection reset before the answer")
            return result

        return recorded


async def _recorded(base_id: str, lose_answer_to: str | None = None) -> Recording:
    """Record the writes of this process's handle on the base (the one its handlers use)."""
    stores = stores_for(Settings())
    index = await stores.index(base_id, stores.embedder.dimension)
    index.client = Recording(index.client, lose_answer_to)
    return index.client


async def _attempt(svc: Any, task_id: uuid.UUID) -> TaskContext:
    claim = await svc.repo.claim(task_id, svc.registry, capacity=10, lease_seconds=30)
    assert not isinstance(claim, str), claim
    return TaskContext(svc.repo, dict(claim.task), claim.token, claim.attempt)


def _chunk_rows(svc: Any, file_id: str) -> Callable[[], Any]:
    return lambda: scalar(svc, "SELECT count(*) FROM knowledge_chunks WHERE file_id = :id", id=file_id)


async def test_an_uploads_first_attempt_inserts_its_vectors_and_a_reindex_upserts_them(
    knowledge_stores: dict[str, str],
) -> None:
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        calls = await _recorded(base)
        file_id = (await upload(client, base, [("doc.txt", TEXT)])).json()["files"][0]["id"]
        assert await run_pending(svc) == ["success"]
        chunks = (await file_row(svc, file_id))["chunk_count"]
        assert chunks > 1 and calls.writes == ["insert"]
        milvus = milvus_client(knowledge_stores)
        assert vector_count(milvus, base, file_id) == chunks

        assert (await client.post(f"/knowledge/files/{file_id}/reindex", headers=ALICE)).status_code == 202
        assert await run_pending(svc) == ["success"]
        assert calls.writes == ["insert", "upsert"]
        assert vector_count(milvus, base, file_id) == chunks == await _chunk_rows(svc, file_id)()


async def test_an_attempt_after_one_that_wrote_the_vectors_upserts_them(
    knowledge_stores: dict[str, str],
) -> None:
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        entry = (await upload(client, base, [("doc.txt", TEXT)])).json()["files"][0]
        file_id, task_id = entry["id"], uuid.UUID(entry["task_id"])
        # Attempt 1 writes the vectors; the answer is lost, so it waits the store out (retry).
        calls = await _recorded(base, lose_answer_to="insert")
        first = await _attempt(svc, task_id)
        with pytest.raises(RetryableError):
            await index_file(first, stores_for(Settings()), file_id)
        assert (await file_row(svc, file_id))["status"] == INDEXING
        chunk_rows = await _chunk_rows(svc, file_id)()
        milvus = milvus_client(knowledge_stores)
        assert calls.writes == ["insert"] and vector_count(milvus, base, file_id) == chunk_rows

        # The task goes back to pending (as the runtime does with a RetryableError); attempt 2
        # finds the chunk rows attempt 1 wrote, so it may not insert: it upserts.
        report = await lapse_and_reconcile(svc, task_id)
        assert report.retried == 1
        second = await _attempt(svc, task_id)
        assert second.attempt == 2
        outcome = await index_file(second, stores_for(Settings()), file_id)
        assert outcome.status == INDEXED and calls.writes == ["insert", "upsert"]
        assert vector_count(milvus, base, file_id) == outcome.chunks == await _chunk_rows(svc, file_id)()
