"""Ingest and search with DTASK_EMBEDDER=openai, in this process (the api and ``run_task`` as a
worker runs it) on real Milvus and S3, against a real HTTP server that fails on request: a
permanent answer ends the file error_indexing at once with the server's message; a server that is
away past the budget sends the task back to pending and the next attempt indexes the file; a search
while it is away answers 503."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from domains.knowledge import stores
from domains.knowledge.cache import PerProcess
from tasks_core.worker.runtime import run_task
from tests.embedding_server import Answer, EmbeddingServer
from tests.knowledge_helpers import ALICE, create_base, file_row, knowledge_api, run_pending, upload

pytestmark = pytest.mark.usefixtures("clean_db")


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch, knowledge_stores: dict[str, str]) -> Iterator[EmbeddingServer]:
    s = EmbeddingServer(dimension=48, model="mini").start()
    monkeypatch.setattr(stores, "_registry", PerProcess())  # this test's embedder settings
    for name, value in {
        "DTASK_EMBEDDER": "openai",
        "DTASK_EMBEDDING_URL": s.url,
        "DTASK_EMBEDDING_MODEL": s.model,
        "DTASK_EMBEDDING_DIMENSION": "48",
        "DTASK_EMBEDDING_RETRY_SECONDS": "1",
        "DTASK_EMBEDDING_BACKOFF_SECONDS": "0.1",
    }.items():
        monkeypatch.setenv(name, value)
    yield s
    s.stop()


async def test_a_permanent_answer_ends_the_file_error_indexing_with_the_servers_message(
    server: EmbeddingServer,
) -> None:
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        server.fail_next(Answer(400, body={"error": {"message": "input is too long: 9000 tokens > 512"}}))
        r = await upload(client, base, [("long.txt", b"a long passage of words")])
        assert r.status_code == 202, r.text
        [entry] = r.json()["files"]
        assert await run_pending(svc) == ["failed"]
        row = await file_row(svc, entry["id"])
        assert row["status"] == "error_indexing"
        message = row["error_message"]
        assert "answered 400" in message and "input is too long: 9000 tokens > 512" in message, message
        assert "\n" not in message
        assert len(server.requests) == 1  # not retried
        task = (await client.get(f"/tasks/{entry['task_id']}", headers=ALICE)).json()
        assert task["attempt_count"] == 1


async def test_a_server_away_past_the_budget_sends_the_task_back_and_the_next_attempt_indexes(
    server: EmbeddingServer,
) -> None:
    async with knowledge_api(retry_backoff_seconds=0) as (client, svc):
        base = await create_base(client)
        server.stop()
        r = await upload(client, base, [("note.txt", b"alpha beta gamma")])
        assert r.status_code == 202, r.text
        [entry] = r.json()["files"]
        started = time.monotonic()
        await run_task(svc, entry["task_id"])
        assert time.monotonic() - started < 5  # the 1 s budget, not the 30 s request timeout
        task = (await client.get(f"/tasks/{entry['task_id']}", headers=ALICE)).json()
        assert task["status"] == "pending" and task["attempt_count"] == 1, task
        assert "embedding endpoint" in task["message"]
        # The api cannot embed a query either: 503, not 500.
        r = await client.post(
            f"/knowledge/bases/{base}/search", json={"query": "alpha", "top_k": 1}, headers=ALICE
        )
        assert r.status_code == 503, r.text
        assert "embedding endpoint" in r.json()["detail"]

        server.start()
        assert await run_pending(svc) == ["success"]
        row = await file_row(svc, entry["id"])
        assert row["status"] == "indexed"
        hits = (
            await client.post(
                f"/knowledge/bases/{base}/search", json={"query": "alpha", "top_k": 1}, headers=ALICE
            )
        ).json()["hits"]
        assert hits[0]["file_id"] == entry["id"]
