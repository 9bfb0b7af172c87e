"""A 100-file ingest through a real worker whose embedder is the OpenAI-compatible client
(DTASK_EMBEDDER=openai) talking to a real HTTP server that answers 429 with Retry-After and 503 now
and then, and goes fully down for 10 s in the middle of the run. The retry budget (3 s) is shorter
than the outage, so both paths run: retries inside the attempt, and attempts handed back to pending
when the budget is spent. Every file ends indexed with exactly one vector per chunk row, and the
retries are counted at /metrics."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from domains.knowledge import stores
from domains.knowledge.cache import PerProcess
from tasks_core import metrics
from tests.embedding_server import Answer, EmbeddingServer
from tests.knowledge_helpers import (
    ALICE,
    ROOT,
    create_base,
    knowledge_api,
    milvus_client,
    paragraphs,
    scalar,
    upload,
)
from tests.system.conftest import Cluster, wait_for

pytestmark = pytest.mark.system

FILES = 100
CAPACITY = 4
OUTAGE_SECONDS = 10.0


@pytest.fixture
def flaky_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[EmbeddingServer]:
    server = EmbeddingServer(dimension=64, model="flaky-minilm").start()
    server.fail_every(10, Answer(429, {"Retry-After": "1"}, {"error": {"message": "rate limit reached"}}))
    server.fail_every(17, Answer(503, body={"error": "server busy"}))
    # The in-process api (it creates the base and searches) embeds through the same server, with
    # a process cache of its own for this test.
    monkeypatch.setattr(stores, "_registry", PerProcess())
    for name, value in embedding_env(server).items():
        monkeypatch.setenv(name, value)
    yield server
    server.stop()


def embedding_env(server: EmbeddingServer) -> dict[str, str]:
    # No DTASK_EMBEDDING_DIMENSION: every worker process probes the server once.
    return {
        "DTASK_EMBEDDER": "openai",
        "DTASK_EMBEDDING_URL": server.url,
        "DTASK_EMBEDDING_MODEL": server.model,
        "DTASK_EMBEDDING_RETRY_SECONDS": "3",
        "DTASK_EMBEDDING_BACKOFF_SECONDS": "0.2",
    }


def _metric(text: str, name: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_total" or sample.name == name:
                found[next(iter(sample.labels.values()), "")] = sample.value
    return found


async def _vectors_by_file(env: dict[str, str], base: str) -> Counter[str]:
    client = milvus_client(env)
    rows = await asyncio.to_thread(
        client.query,
        f"kb_{base}",
        filter="",
        output_fields=["file_id"],
        limit=16384,
        consistency_level="Strong",
    )
    return Counter(row["file_id"] for row in rows)


async def test_an_embedding_outage_mid_ingest_leaves_every_file_indexed_once(
    cluster: Cluster, knowledge_stores: dict[str, str], flaky_server: EmbeddingServer
) -> None:
    env = {
        **knowledge_stores,
        **embedding_env(flaky_server),
        "DTASK_CAPACITY": str(CAPACITY),
        # Handed-back attempts come back within a few seconds of the server's return.
        "DTASK_RETRY_BACKOFF_SECONDS": "1",
        "DTASK_RETRY_BACKOFF_MAX_SECONDS": "4",
    }
    worker = cluster.start_worker(concurrency=CAPACITY + 2, **env)
    # Beat publishes the handed-back tasks when their backoff ends (and reconciles a lapsed lease).
    cluster.start_beat(**env)
    await cluster.wait_worker_ready(worker)
    async with knowledge_api(metrics_cache_seconds=0) as (client, svc):
        base = await create_base(client)
        files = [
            (
                f"doc-{i:03d}.md",
                paragraphs([f"topic{i}", "outage", "vectors", f"word{i % 7}"], 3, seed=i).encode(),
            )
            for i in range(FILES)
        ]
        started = time.monotonic()
        r = await upload(client, base, files)
        assert r.status_code == 202, r.text

        async def indexed_count() -> int:
            return int(
                await scalar(
                    svc,
                    "SELECT count(*) FROM knowledge_files WHERE kb_id = :kb AND status = 'indexed'",
                    kb=base,
                )
            )

        async def some_indexed() -> bool:
            assert worker.alive()
            return await indexed_count() >= 20

        await wait_for(some_indexed, within=60, interval=0.1, what="the first files indexed")
        flaky_server.stop()
        down_at, stopped = await indexed_count(), time.monotonic() - started
        await asyncio.sleep(OUTAGE_SECONDS)
        flaky_server.start()

        async def statuses() -> dict[str, int] | None:
            assert worker.alive()
            async with svc.engine.connect() as conn:
                rows = (
                    await conn.execute(
                        text(
                            "SELECT status, count(*) FROM knowledge_files WHERE kb_id = :kb GROUP BY status"
                        ),
                        {"kb": base},
                    )
                ).all()
            counts = {status: int(n) for status, n in rows}
            return counts if counts.get("indexed", 0) + counts.get("error_indexing", 0) == FILES else None

        counts = await wait_for(statuses, within=180, interval=0.2, what="every file settled")
        elapsed = time.monotonic() - started
        assert counts == {"indexed": FILES}, counts
        assert down_at < FILES  # the outage really fell in the middle of the run

        # Exactly one vector per chunk row, file by file: nothing lost, nothing doubled.
        async with svc.engine.connect() as conn:
            chunk_rows = dict(
                (
                    await conn.execute(
                        text(
                            "SELECT c.file_id, count(*) FROM knowledge_chunks c JOIN knowledge_files f "
                            "USING (file_id) WHERE f.kb_id = :kb GROUP BY c.file_id"
                        ),
                        {"kb": base},
                    )
                ).all()
            )
            chunk_counts = dict(
                (
                    await conn.execute(
                        text("SELECT file_id, chunk_count FROM knowledge_files WHERE kb_id = :kb"),
                        {"kb": base},
                    )
                ).all()
            )
        vectors = await _vectors_by_file(knowledge_stores, base)
        assert len(chunk_rows) == FILES
        assert dict(vectors) == chunk_rows == chunk_counts

        # Some attempts ran out of their 3 s budget in the 10 s outage and were handed back.
        handed_back = await scalar(svc, "SELECT count(*) FROM task_attempts WHERE outcome = 'retry'")
        assert handed_back >= 1
        # Every file's task succeeded (small files of one upload share a task).
        tasks = await scalar(svc, "SELECT count(DISTINCT task_id) FROM knowledge_files")
        assert await scalar(svc, "SELECT count(*) FROM tasks WHERE status = 'success'") == tasks

        # The worker's retries reach Redis (each worker process flushes its counts every second;
        # read before any /metrics call, which would add this process's own), then /metrics.
        async def counted() -> tuple[dict[str, float], dict[str, float]] | None:
            shared = [(*metrics.parse_field(f), v) for f, v in (await metrics.read(svc.redis)).items()]
            retries = {labels["reason"]: v for name, labels, v in shared if name == "dtask_embedding_retries"}
            failures = {labels["kind"]: v for name, labels, v in shared if name == "dtask_embedding_failures"}
            wanted = ("429", "503", "connection")
            return (retries, failures) if all(retries.get(k, 0) > 0 for k in wanted) else None

        retries, failures = await wait_for(counted, within=10, interval=0.5, what="the worker's retries")
        assert failures.get("unavailable", 0) >= handed_back
        assert "rejected" not in failures
        r = await client.get("/metrics", headers=ROOT)
        assert r.status_code == 200, r.text
        rendered = _metric(r.text, "dtask_embedding_retries")
        assert all(rendered.get(reason, 0) >= n for reason, n in retries.items()), (rendered, retries)
        hits = (
            await client.post(
                f"/knowledge/bases/{base}/search", json={"query": "topic42 outage", "top_k": 1}, headers=ALICE
            )
        ).json()["hits"]
        assert hits[0]["filename"] == "doc-042.md"
        print(
            f"{FILES} files indexed in {elapsed:.1f} s through a {OUTAGE_SECONDS:.0f} s outage "
            f"({down_at} before it, at {stopped:.1f} s); {len(flaky_server.requests)} requests, "
            f"retries {retries}, gave up {failures}, {handed_back} attempts handed back"
        )
