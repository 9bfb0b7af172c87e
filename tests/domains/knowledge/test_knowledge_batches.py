"""Ingest tasks of several files (an upload groups a request's small files): each file keeps its own
fenced states and outcome. One unreadable file fails only itself; an attempt that lost its lease
writes nothing for any of its files; a store failure mid-task retries, and the next attempt skips
the files already indexed; deleting one file leaves the task to the others. Real PostgreSQL, Milvus
and S3; the worker's run (claim, handler, terminal write) in this process."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import text

from domains.knowledge import catalog, handlers
from domains.knowledge.errors import StoreUnavailable
from domains.knowledge.handlers import index_files
from domains.knowledge.model import INDEXED, INDEXING, PARSING
from domains.knowledge.stores import stores_for
from domains.knowledge.vectors import BaseIndex
from tasks_core.settings import Settings
from tasks_core.store.outcomes import OwnershipLost
from tasks_core.worker.context import TaskContext
from tasks_core.worker.runtime import run_task
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


def _docs(n: int, tag: str = "doc") -> list[tuple[str, bytes]]:
    return [(f"{tag}-{i}.txt", f"{tag} {i} talks about batch{i} and shared tasks".encode()) for i in range(n)]


async def _tasks(svc: Any) -> list[dict[str, Any]]:
    async with svc.engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT id, status, payload, error FROM tasks ORDER BY created_at, id")
        )
        return [dict(r) for r in rows.mappings()]


async def _vectors_match_chunks(svc: Any, stores: dict[str, str], base: str, file_ids: list[str]) -> None:
    milvus = milvus_client(stores)
    for file_id in file_ids:
        row = await file_row(svc, file_id)
        assert row["status"] == INDEXED and row["chunk_count"] >= 1, row
        chunks = await scalar(svc, "SELECT count(*) FROM knowledge_chunks WHERE file_id = :id", id=file_id)
        assert vector_count(milvus, base, file_id) == chunks == row["chunk_count"]


async def test_a_requests_files_share_few_tasks_and_an_unreadable_one_fails_only_itself(
    knowledge_stores: dict[str, str],
) -> None:
    # The owner may run two tasks at once (the default half of capacity 4): six files, two tasks.
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        sent = [*_docs(4), ("blank.txt", b"   \n\t "), ("last.txt", b"the last words here")]
        entries = (await upload(client, base, sent)).json()["files"]
        tasks = await _tasks(svc)
        assert len(tasks) == 2
        assert [t["payload"] for t in tasks] == [
            {"file_ids": [e["id"] for e in entries[:3]]},
            {"file_ids": [e["id"] for e in entries[3:]]},
        ]
        assert [e["task_id"] for e in entries] == [str(tasks[0]["id"])] * 3 + [str(tasks[1]["id"])] * 3
        for e in entries:  # the file -> task link, as the API shows it
            shown = (await client.get(f"/knowledge/files/{e['id']}", headers=ALICE)).json()
            assert shown["task_id"] == e["task_id"]

        assert await run_pending(svc) == ["success", "failed"]
        blank = entries[4]["id"]
        row = await file_row(svc, blank)
        assert row["status"] == "error_parsing" and "no text" in row["error_message"], row
        error = (await _tasks(svc))[1]["error"]
        assert (
            error["code"] == "handler_error"
            and "1 of 3 files" in error["message"]
            and blank in error["message"]
        )
        good = [e["id"] for e in entries if e["id"] != blank]
        await _vectors_match_chunks(svc, knowledge_stores, base, good)
        result = await scalar(svc, "SELECT result FROM tasks WHERE id = :id", id=tasks[0]["id"])
        assert result["files"] == 3 and result["indexed"] == 3


async def test_an_expired_attempt_writes_nothing_for_any_of_its_files_after_a_new_one_took_over(
    knowledge_stores: dict[str, str],
) -> None:
    async with knowledge_api(owner_max_running=1) as (client, svc):  # one slot: one task of three
        base = await create_base(client)
        entries = (await upload(client, base, _docs(3))).json()["files"]
        ids = [e["id"] for e in entries]
        task_id = uuid.UUID(entries[0]["task_id"])
        assert {e["task_id"] for e in entries} == {str(task_id)}

        async def attempt() -> TaskContext:
            claim = await svc.repo.claim(task_id, svc.registry, capacity=10, lease_seconds=30)
            assert not isinstance(claim, str), claim
            return TaskContext(svc.repo, dict(claim.task), claim.token, claim.attempt)

        # Attempt A takes every file to `indexing`, as its handler's first transactions would.
        a = await attempt()
        async with a.owning_transaction() as conn:
            assert len(await catalog.start_many(conn, ids, a.task_id, a.attempt_token)) == 3
            assert await catalog.advance_many(
                conn, ids, a.task_id, a.attempt_token, PARSING, INDEXING
            ) == set(ids)
        # A falls silent; the reconciler hands the task back; attempt B starts the files over.
        report = await lapse_and_reconcile(svc, task_id)
        assert report.retried == 1
        b = await attempt()
        assert b.attempt == 2
        stores = stores_for(Settings())
        async with b.owning_transaction() as conn:
            assert len(await catalog.start_many(conn, ids, b.task_id, b.attempt_token)) == 3

        # A wakes up: its owning transactions are refused, its handler writes nothing...
        with pytest.raises(OwnershipLost):
            await index_files(a, stores, ids)
        # ...and the files' own fence refuses even statements that skip the task check.
        async with svc.engine.begin() as conn:
            for expect in (INDEXING, PARSING):
                assert not await catalog.advance_many(
                    conn, ids, a.task_id, a.attempt_token, expect, INDEXED, [9, 9, 9]
                )
            assert not await catalog.fail_many(
                conn, {f: ("error_parsing", "late") for f in ids}, a.task_id, a.attempt_token
            )
            assert not await catalog.note_many(conn, ids, a.task_id, a.attempt_token, "late")
        for file_id in ids:
            row = await file_row(svc, file_id)
            assert (row["status"], row["attempt_token"], row["error_message"]) == (
                PARSING,
                b.attempt_token,
                None,
            )
        assert vector_count(milvus_client(knowledge_stores), base) == 0

        # B indexes them all; every vector once (attempt 2 upserts).
        outcomes = await index_files(b, stores, ids)
        assert [(o.file_id, o.status) for o in outcomes] == [(f, INDEXED) for f in ids]
        await _vectors_match_chunks(svc, knowledge_stores, base, ids)


async def test_a_store_failure_mid_task_retries_and_the_next_attempt_skips_the_indexed_files(
    knowledge_stores: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(handlers, "ROUND_CHUNKS", 1)  # a round per file: the first is indexed alone
    real_insert = BaseIndex.insert
    calls = 0

    async def insert(self: BaseIndex, files: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise StoreUnavailable("Milvus", "stalled (injected)")
        await real_insert(self, files)

    monkeypatch.setattr(BaseIndex, "insert", insert)
    async with knowledge_api(owner_max_running=1, retry_backoff_seconds=0.0) as (client, svc):
        base = await create_base(client)
        entries = (await upload(client, base, _docs(3))).json()["files"]
        ids = [e["id"] for e in entries]
        task_id = entries[0]["task_id"]

        assert (await run_task(svc, task_id)).status == "pending"  # back with backoff
        first = await file_row(svc, ids[0])
        assert first["status"] == INDEXED
        for file_id in ids[1:]:
            row = await file_row(svc, file_id)
            assert row["status"] in (PARSING, INDEXING) and "attempt 1: Milvus" in row["error_message"], row

        assert (await run_task(svc, task_id)).status == "success"
        assert (await file_row(svc, ids[0]))["updated_at"] == first["updated_at"]  # not touched again
        await _vectors_match_chunks(svc, knowledge_stores, base, ids)
        result = await scalar(svc, "SELECT result FROM tasks WHERE id = :id", id=task_id)
        assert result == {"files": 3, "indexed": 3, "chunks": 2}  # this attempt's: the last two files


async def test_deleting_one_file_of_a_shared_task_leaves_the_task_to_the_others(
    knowledge_stores: dict[str, str],
) -> None:
    async with knowledge_api(owner_max_running=1) as (client, svc):
        base = await create_base(client)
        entries = (await upload(client, base, _docs(3))).json()["files"]
        ids = [e["id"] for e in entries]
        assert (await client.delete(f"/knowledge/files/{ids[1]}", headers=ALICE)).status_code == 204
        assert (await _tasks(svc))[0]["status"] == "pending"  # not cancelled
        assert await run_pending(svc) == ["success"]
        await _vectors_match_chunks(svc, knowledge_stores, base, [ids[0], ids[2]])
        assert vector_count(milvus_client(knowledge_stores), base, ids[1]) == 0
        assert (await client.get(f"/knowledge/files/{ids[1]}", headers=ALICE)).status_code == 404
