"""graph.build through real `celery worker` processes: the worker holding a build is SIGKILLed
midway, the runtime retries the build by itself (retry-safe), and the graph it ends with is exactly
the graph of an uninterrupted build (the tables compared row for row)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from tests.graph_helpers import build_row, corpus, expected_tables, graph_tables, make_base
from tests.knowledge_helpers import ALICE, knowledge_api, scalar
from tests.system.conftest import Cluster, wait_for

pytestmark = pytest.mark.system

BATCH = 5
HOLD_AFTER = 3 * BATCH  # three batches committed, the fourth held in extraction


async def _task(client: Any, task_id: str, status: str) -> dict[str, Any] | None:
    task: dict[str, Any] = (await client.get(f"/tasks/{task_id}", headers=ALICE)).json()
    return task if task["status"] == status else None


async def test_a_build_whose_worker_is_killed_retries_by_itself_and_ends_with_the_clean_graph(
    cluster: Cluster, tmp_path: Path
) -> None:
    gate = tmp_path / "graph-gate"
    gate.touch()
    env: dict[str, Any] = {
        "DTASK_GRAPH_EXTRACTOR": "tests.graph_extractors:GateExtractor",
        "DTASK_TEST_GRAPH_GATE": str(gate),
        "DTASK_TEST_GRAPH_HOLD_AFTER": str(HOLD_AFTER),
        "DTASK_GRAPH_BATCH_CHUNKS": str(BATCH),
        "DTASK_RETRY_BACKOFF_SECONDS": "0.5",
    }
    # Two workers: the one holding the build is killed, the other recovers and retries it.
    workers = [cluster.start_worker(f"worker{i}", concurrency=2, **env) for i in (1, 2)]
    cluster.start_beat()
    for w in workers:
        await cluster.wait_worker_ready(w)
    await cluster.wait_readiness_fact()
    files = corpus(files=5, chunks_per_file=12, seed=11)
    texts = [t for f in files for t in f]
    async with knowledge_api() as (client, svc):
        base, _ = await make_base(svc, files)
        r = await client.post(f"/graph/{base}/build", headers=ALICE)
        assert r.status_code == 202, r.text
        task_id, build_id = r.json()["task_id"], uuid.UUID(r.json()["build_id"])

        async def held() -> bool:
            return await asyncio.to_thread(Path(f"{gate}.entered").exists)

        await wait_for(held, within=60, what="the worker to be held in the middle of the build")
        row = await build_row(svc, build_id)
        assert (row["status"], row["chunks_done"], row["chunk_total"]) == ("building", HOLD_AFTER, len(texts))
        owner = await scalar(svc, "SELECT worker FROM task_attempts WHERE task_id = :id", id=task_id)
        [holder] = [w for w in workers if owner.startswith(f"{w.node}:")]
        holder.killpg()
        gate.unlink()  # the retry, on the other worker, runs through

        task = await wait_for(lambda: _task(client, task_id, "success"), within=60, what="the retried build")
        assert task["attempt_count"] == 2
        assert task["result"]["resumed_from"] == HOLD_AFTER and task["result"]["chunks"] == len(texts)
        async with svc.engine.connect() as conn:
            outcomes = (
                (
                    await conn.execute(
                        text("SELECT outcome FROM task_attempts WHERE task_id = :id ORDER BY attempt"),
                        {"id": uuid.UUID(task_id)},
                    )
                )
                .scalars()
                .all()
            )
        assert outcomes[0] == "lease_expired" and len(outcomes) == 2
        retried = await graph_tables(svc, build_id)
        assert retried == expected_tables(texts)

        # An uninterrupted build of the same base, by the surviving worker: the same tables.
        r = await client.post(f"/graph/{base}/build", headers=ALICE)
        assert r.status_code == 202, r.text
        clean_task = r.json()["task_id"]
        task = await wait_for(lambda: _task(client, clean_task, "success"), within=60, what="the clean build")
        assert task["attempt_count"] == 1 and task["result"]["resumed_from"] == 0
        clean = await graph_tables(svc, uuid.UUID(r.json()["build_id"]))
        assert clean == retried
        assert len(clean[0]) > 10 and len(clean[1]) > 10
