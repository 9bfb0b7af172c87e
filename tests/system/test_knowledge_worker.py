"""Knowledge ingestion through real `celery worker` processes, real Milvus (milvus-lite server) and
real S3 (SeaweedFS): a 400-file batch carried by the relay alone, a worker SIGKILLed while it
indexes a file (its retry-safe task runs again elsewhere), and a folder whose bad files (empty,
binary, a PDF of no pages) end error_parsing beside its 20 good ones, uploaded twice as one."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from tests.integration.repo_helpers import attempt_rows
from tests.knowledge_helpers import (
    ALICE,
    create_base,
    file_row,
    knowledge_api,
    make_empty_pdf,
    milvus_client,
    paragraphs,
    scalar,
    upload,
    vector_count,
)
from tests.system.conftest import Cluster, wait_for

pytestmark = pytest.mark.system

CAPACITY = 4
BATCH = 400


async def _statuses(svc: Any, base_id: str) -> dict[str, int]:
    async with svc.engine.connect() as conn:
        rows = (
            await conn.execute(
                text("SELECT status, count(*) FROM knowledge_files WHERE kb_id = :kb GROUP BY status"),
                {"kb": base_id},
            )
        ).all()
    return {status: int(n) for status, n in rows}


async def _max_overlap(svc: Any, task_ids: list[str]) -> int:
    """Most attempts holding a claim at one instant (from the attempts audit trail, PostgreSQL's clock)."""
    async with svc.engine.connect() as conn:
        rows = (
            await conn.execute(
                text("SELECT claimed_at, ended_at FROM task_attempts WHERE task_id = ANY(:ids)"),
                {"ids": [uuid.UUID(t) for t in task_ids]},
            )
        ).all()
    events = sorted([(c, 1) for c, _ in rows] + [(e, -1) for _, e in rows])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


async def test_400_files_in_one_upload_all_reach_indexed_without_the_periodic_publisher(
    cluster: Cluster, knowledge_stores: dict[str, str]
) -> None:
    # No beat at all: nothing re-publishes. Every task past the first few runs only because a
    # finishing task relays the freed slot.
    worker = cluster.start_worker(concurrency=CAPACITY + 2, DTASK_CAPACITY=str(CAPACITY), **knowledge_stores)
    await cluster.wait_worker_ready(worker)
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        files = [
            (f"note-{i:03d}.txt", f"note {i} about topic{i} and shared words".encode()) for i in range(BATCH)
        ]
        started = time.monotonic()
        r = await upload(client, base, files)
        assert r.status_code == 202, r.text
        entries = r.json()["files"]
        assert len(entries) == BATCH
        # The publish of 400 ids is bounded (DTASK_PUBLISH_TIMEOUT_SECONDS); on a busy machine it can
        # run past that and the rows are marked for re-sending: the relay (not beat) sends them then.
        published = r.json()["published"]

        # Each file's task that is still waiting says why (newest first: the most likely to wait).
        waiting = 0
        for entry in reversed(entries):
            task = (await client.get(f"/tasks/{entry['task_id']}", headers=ALICE)).json()
            if task["status"] == "pending":
                waiting += 1
                assert task["waiting_reason"], task
        assert waiting > 0  # the batch is far larger than the capacity

        async def all_indexed() -> dict[str, int] | None:
            assert worker.alive()
            counts = await _statuses(svc, base)
            return counts if counts.get("indexed") == BATCH else None

        await wait_for(all_indexed, within=240, interval=0.5, what=f"{BATCH} files indexed")
        elapsed = time.monotonic() - started
        task_ids = [e["task_id"] for e in entries]
        # Small files of one request share tasks: each file's task succeeded.
        assert await scalar(svc, "SELECT count(*) FROM tasks WHERE status = 'success'") == len(set(task_ids))
        assert 1 < len(set(task_ids)) < BATCH
        peak = await _max_overlap(svc, task_ids)
        print(
            f"{BATCH} files indexed in {elapsed:.1f} s ({BATCH / elapsed:.1f} files/s), "
            f"peak running {peak}, {waiting} seen waiting, published at once: {published}"
        )
        assert 1 <= peak <= CAPACITY
        assert vector_count(milvus_client(knowledge_stores), base) == BATCH
        hits = (
            await client.post(
                f"/knowledge/bases/{base}/search", json={"query": "topic123", "top_k": 1}, headers=ALICE
            )
        ).json()["hits"]
        assert hits[0]["file_id"] == entries[123]["id"]


async def test_sigkill_while_indexing_retries_the_file_and_leaves_no_duplicate_vectors(
    cluster: Cluster, knowledge_stores: dict[str, str], tmp_path: Path
) -> None:
    gate = tmp_path / "embed-gate"
    gate.touch()
    env = {
        **knowledge_stores,
        "DTASK_EMBEDDER": "tests.knowledge_embedders:GateEmbedder",
        "DTASK_TEST_EMBED_GATE": str(gate),
    }
    # Two workers: the one holding the file is killed, the other recovers it (reconciler duty).
    workers = [cluster.start_worker(f"worker{i}", concurrency=2, **env) for i in (1, 2)]
    cluster.start_beat()
    for w in workers:
        await cluster.wait_worker_ready(w)
    await cluster.wait_readiness_fact()
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        words = [f"word{i}" for i in range(50)]
        entry = (await upload(client, base, [("long.md", paragraphs(words, 150).encode())])).json()["files"][
            0
        ]
        file_id = entry["id"]
        milvus = milvus_client(knowledge_stores)

        # Held inside indexing with the first batch of vectors already written.
        async def held() -> bool:
            return await asyncio.to_thread(Path(f"{gate}.entered").exists)

        await wait_for(held, within=60, what="the worker to be held while indexing")
        row = await file_row(svc, file_id)
        assert row["status"] == "indexing"
        partial = vector_count(milvus, base, file_id)
        assert partial > 0
        owner = await scalar(svc, "SELECT worker FROM task_attempts WHERE task_id = :id", id=entry["task_id"])
        [holder] = [w for w in workers if owner.startswith(f"{w.node}:")]
        holder.killpg(signal.SIGKILL)

        # Ingest is retry-safe: the reconciler sends the task back to pending, and the other worker
        # runs its second attempt, which starts the file over. No person is involved.
        async def retried() -> dict[str, Any] | None:
            task = (await client.get(f"/tasks/{entry['task_id']}", headers=ALICE)).json()
            return task if task["attempt_count"] == 2 else None

        await wait_for(retried, within=30, what="the second attempt")
        first = await attempt_rows(svc.engine, uuid.UUID(entry["task_id"]))
        assert first[0]["outcome"] == "lease_expired"
        gate.unlink()

        async def indexed() -> dict[str, Any] | None:
            row = await file_row(svc, file_id)
            return row if row["status"] in ("indexed", "error_indexing", "error_parsing") else None

        row = await wait_for(indexed, within=60, what="the file indexed by the second attempt")
        assert row["status"] == "indexed", row
        chunks = row["chunk_count"]
        assert chunks > partial
        # Exactly one vector per chunk: the killed attempt's batch was replaced, not duplicated.
        assert vector_count(milvus, base, file_id) == chunks == vector_count(milvus, base)
        assert (
            await scalar(svc, "SELECT count(*) FROM knowledge_chunks WHERE file_id = :id", id=file_id)
            == chunks
        )
        await asyncio.sleep(0)




async def test_a_folder_with_bad_files_indexes_the_good_ones_and_the_same_file_twice_is_one(
    cluster: Cluster, knowledge_stores: dict[str, str], tmp_path: Path
) -> None:
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(20):
        words = [f"good{i}word{k}" for k in range(8)] + ["shared", "handbook", "words"]
        (folder / f"doc-{i:02}.md").write_text(paragraphs(words, 3, seed=i))
    (folder / "empty.txt").write_bytes(b"")
    (folder / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 16)
    (folder / "scan.pdf").write_bytes(make_empty_pdf())
    bad = {
        "empty.txt": "the file is empty",
        "photo.png": "not a supported file type",
        "scan.pdf": "the PDF has no pages",
    }
    worker = cluster.start_worker(concurrency=CAPACITY + 2, DTASK_CAPACITY=str(CAPACITY), **knowledge_stores)
    cluster.start_beat()
    await cluster.wait_worker_ready(worker)
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        sent = [(p.name, p.read_bytes()) for p in sorted(folder.iterdir())]
        r = await upload(client, base, sent)
        assert r.status_code == 202, r.text
        entries = {e["filename"]: e for e in r.json()["files"]}
        assert len(entries) == 23

        async def settled() -> dict[str, int] | None:
            assert worker.alive()
            counts = await _statuses(svc, base)
            return counts if counts.get("indexed", 0) + counts.get("error_parsing", 0) == 23 else None

        counts = await wait_for(settled, within=120, interval=0.5, what="every file indexed or failed")
        assert counts == {"indexed": 20, "error_parsing": 3}, counts
        for name, why in bad.items():
            row = await file_row(svc, entries[name]["id"])
            assert row["status"] == "error_parsing" and why in row["error_message"], row
        milvus = milvus_client(knowledge_stores)
        for i in range(20):
            row = await file_row(svc, entries[f"doc-{i:02}.md"]["id"])
            assert row["status"] == "indexed"
            assert vector_count(milvus, base, row["file_id"]) == row["chunk_count"]

        # The same file again: the file the base has, nothing stored or indexed again.
        tasks_before = await scalar(svc, "SELECT count(*) FROM tasks")
        r = await upload(client, base, [("doc-07-again.md", (folder / "doc-07.md").read_bytes())])
        assert r.status_code == 202, r.text
        [again] = r.json()["files"]
        assert again["duplicate_of"] == again["id"] == entries["doc-07.md"]["id"]
        assert again["status"] == "indexed"
        assert await scalar(svc, "SELECT count(*) FROM tasks") == tasks_before
        assert await scalar(svc, "SELECT count(*) FROM knowledge_files WHERE kb_id = :kb", kb=base) == 23
        hits = (
            await client.post(
                f"/knowledge/bases/{base}/search",
                json={"query": "good7word1 good7word2 good7word3", "top_k": 3},
                headers=ALICE,
            )
        ).json()["hits"]
        assert hits[0]["filename"] == "doc-07.md" and len({h["text"] for h in hits}) == len(hits)
