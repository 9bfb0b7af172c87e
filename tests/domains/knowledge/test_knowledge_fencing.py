"""An attempt that lost its lease can never move its file on: not after the reconciler failed its task,
and not after a new task's attempt took the file over. Driven through the repository and the
domain's own fenced statements, on the real database (and real stores for the upload)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import text

from domains.knowledge import catalog
from domains.knowledge.handlers import index_file
from domains.knowledge.model import INDEXED, INDEXING, PARSED, PARSING
from domains.knowledge.stores import stores_for
from domains.knowledge.tasks import MAX_ATTEMPTS
from tasks_core.settings import Settings
from tasks_core.store.outcomes import OwnershipLost
from tasks_core.worker.context import TaskContext
from tests.knowledge_helpers import ALICE, create_base, file_row, knowledge_api, upload

pytestmark = pytest.mark.usefixtures("clean_db")


async def _attempt(svc: Any, task_id: uuid.UUID) -> TaskContext:
    repo, registry = svc.repo, svc.registry
    claim = await repo.claim(task_id, registry, capacity=10, lease_seconds=30)
    assert not isinstance(claim, str), claim
    return TaskContext(repo, dict(claim.task), claim.token, claim.attempt)


async def _move(ctx: TaskContext, file_id: str, expect: str, to: str, **values: object) -> bool:
    async with ctx.owning_transaction() as conn:
        return await catalog.advance(conn, file_id, ctx.task_id, ctx.attempt_token, expect, to, **values)


async def _lapse(svc: Any, task_id: uuid.UUID) -> None:
    async with svc.engine.begin() as conn:
        await conn.execute(
            text("UPDATE tasks SET lease_expires_at = clock_timestamp() - interval '1 s' WHERE id = :id"),
            {"id": task_id},
        )


async def test_an_expired_attempt_cannot_mark_its_file_indexed_after_a_new_attempt_took_over(
    knowledge_stores: dict[str, str],
) -> None:
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        entry = (await upload(client, base, [("doc.txt", b"some words " * 40)])).json()["files"][0]
        file_id, task_id = entry["id"], uuid.UUID(entry["task_id"])

        # Attempt A takes the file as far as `indexing`, as its handler would.
        a = await _attempt(svc, task_id)
        async with a.owning_transaction() as conn:
            assert await catalog.start(conn, file_id, a.task_id, a.attempt_token) is not None
        assert await _move(a, file_id, PARSING, PARSED)
        assert await _move(a, file_id, PARSED, INDEXING)

        # A falls silent: its lease lapses (PostgreSQL's clock). Ingest is retry-safe, so the
        # reconciler sends the task back to pending; the file keeps its state until the next attempt.
        await _lapse(svc, task_id)
        report = await svc.repo.reconcile(svc.registry, batch=10, retry_delay=lambda n: 0.0)
        assert report.retried == 1 and report.hook_errors == 0
        assert (await file_row(svc, file_id))["status"] == INDEXING

        # Attempt B of the same task takes the file over and starts it again.
        b = await _attempt(svc, task_id)
        assert b.attempt == 2
        async with b.owning_transaction() as conn:
            assert await catalog.start(conn, file_id, b.task_id, b.attempt_token) is not None

        # A wakes up and tries to finish: the owning transaction refuses it...
        with pytest.raises(OwnershipLost):
            await _move(a, file_id, INDEXING, INDEXED, chunk_count=99)
        # ...and so does the file's own fence, even for a statement that skips the task check.
        async with svc.engine.begin() as conn:
            for expect in (INDEXING, PARSING):
                assert not await catalog.advance(
                    conn, file_id, a.task_id, a.attempt_token, expect, INDEXED, chunk_count=99
                )
        # Running A's whole handler again changes nothing either.
        with pytest.raises(OwnershipLost):
            await index_file(a, stores_for(Settings()), file_id)

        row = await file_row(svc, file_id)
        assert (row["status"], row["task_id"], row["attempt_token"]) == (PARSING, b.task_id, b.attempt_token)
        assert row["chunk_count"] == 0 and row["error_message"] is None

        # B moves on normally.
        assert await _move(b, file_id, PARSING, PARSED)
        assert await _move(b, file_id, PARSED, INDEXING)
        assert await _move(b, file_id, INDEXING, INDEXED, chunk_count=1)
        assert (await file_row(svc, file_id))["status"] == INDEXED


async def test_a_lapse_of_the_last_attempt_fails_the_file_and_a_reindex_takes_it_over(
    knowledge_stores: dict[str, str],
) -> None:
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        entry = (await upload(client, base, [("doc.txt", b"some words " * 40)])).json()["files"][0]
        file_id, first_task = entry["id"], uuid.UUID(entry["task_id"])
        async with svc.engine.begin() as conn:  # every attempt but the last already spent
            await conn.execute(
                text("UPDATE tasks SET attempt_count = :n WHERE id = :id"),
                {"n": MAX_ATTEMPTS - 1, "id": first_task},
            )
        a = await _attempt(svc, first_task)
        assert a.attempt == MAX_ATTEMPTS
        async with a.owning_transaction() as conn:
            assert await catalog.start(conn, file_id, a.task_id, a.attempt_token) is not None
        assert await _move(a, file_id, PARSING, PARSED)
        assert await _move(a, file_id, PARSED, INDEXING)

        # No attempt left: the reconciler fails the task, whose failure hook marks the file inside
        # the same transaction.
        await _lapse(svc, first_task)
        report = await svc.repo.reconcile(svc.registry, batch=10, retry_delay=lambda n: 0.0)
        assert report.failed == 1 and report.hook_errors == 0
        row = await file_row(svc, file_id)
        assert row["status"] == "error_indexing" and "lease_expired" in row["error_message"]

        # The user reindexes: a new task, whose attempt B takes the file over; A's late write fails.
        r = await client.post(f"/knowledge/files/{file_id}/reindex", headers=ALICE)
        assert r.status_code == 202, r.text
        b = await _attempt(svc, uuid.UUID(r.json()["task_id"]))
        async with b.owning_transaction() as conn:
            assert await catalog.start(conn, file_id, b.task_id, b.attempt_token) is not None
        with pytest.raises(OwnershipLost):
            await _move(a, file_id, INDEXING, INDEXED, chunk_count=99)
        row = await file_row(svc, file_id)
        assert (row["status"], row["task_id"], row["attempt_token"]) == (PARSING, b.task_id, b.attempt_token)
