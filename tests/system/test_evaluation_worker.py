"""Evaluation datasets through real `celery worker` processes, a real milvus-lite server and S3:
a generation SIGKILLed midway ends `failed` with the items it committed, a resume finishes it with
exactly the target and no duplicates; a cancelled generation keeps its items and ends `cancelled`
in the same transaction as its task, a worker shut down ends it `failed` (`worker_shutdown`) the
same way; an evaluation run on a worker completes with its metrics."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.evaluation_helpers import assert_distinct, items, rows
from tests.knowledge_helpers import ALICE, create_base, knowledge_api, scalar, upload
from tests.system.conftest import Cluster, wait_for

pytestmark = pytest.mark.system

CHUNKS = 10  # one chunk per document
BATCH = 5  # divides CHUNKS: the gate holds a dataset at exactly CHUNKS committed items
SIZE = 30


async def _state(svc: Any, dataset_id: str) -> dict[str, Any]:
    """The dataset and its task, read in one snapshot."""
    [row] = await rows(
        svc,
        """SELECT d.status, d.item_count, d.error_message, t.status AS task_status, t.error AS task_error
        FROM evaluation_datasets d JOIN tasks t ON t.id = d.task_id WHERE d.id = :id""",
        id=dataset_id,
    )
    return row


async def _ended(svc: Any, dataset_id: str, within: float) -> dict[str, Any]:
    """Poll until the dataset's task is terminal; at no instant is one terminal without the other."""

    async def probe() -> dict[str, Any] | None:
        state = await _state(svc, dataset_id)
        task_done = state["task_status"] in ("success", "failed", "cancelled")
        assert task_done == (state["status"] != "generating"), state
        return state if task_done else None

    return await wait_for(probe, within=within, interval=0.1, what=f"dataset {dataset_id} to end")


async def test_killed_cancelled_or_shut_down_generations_keep_their_items_and_resume_to_exactly_the_target(
    cluster: Cluster, knowledge_stores: dict[str, str], tmp_path: Path
) -> None:
    gate = tmp_path / "generation-gate"
    entered = Path(f"{gate}.entered")
    env = {
        **knowledge_stores,
        "DTASK_EVAL_GENERATOR": "tests.evaluation_generators:GateGenerator",
        "DTASK_TEST_GEN_GATE": str(gate),
        "DTASK_EVAL_BATCH_SIZE": str(BATCH),
    }
    # Two workers: the one generating is killed, the other recovers it (reconciler duty) and runs
    # the rest.
    workers = [cluster.start_worker(f"worker{i}", concurrency=2, **env) for i in (1, 2)]
    cluster.start_beat()
    for w in workers:
        await cluster.wait_worker_ready(w)
    await cluster.wait_readiness_fact()
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        docs = [(f"d{i}.txt", " ".join(f"topic{i}w{j}" for j in range(30)).encode()) for i in range(CHUNKS)]
        assert (await upload(client, base, docs)).status_code == 202

        async def indexed() -> bool:
            n = await scalar(
                svc, "SELECT count(*) FROM knowledge_files WHERE kb_id = :b AND status = 'indexed'", b=base
            )
            return bool(n == CHUNKS)

        await wait_for(indexed, within=60, interval=0.2, what="the base's files indexed")

        async def held() -> bool:
            return await asyncio.to_thread(entered.exists)

        # -- SIGKILL midway
        await asyncio.to_thread(gate.touch)
        r = await client.post("/evaluation/datasets", json={"base_id": base, "size": SIZE}, headers=ALICE)
        assert r.status_code == 202, r.text
        killed = r.json()
        await wait_for(held, within=60, what="the generation to be held after its first batches")
        assert (await _state(svc, killed["id"]))["item_count"] == CHUNKS
        owner = await scalar(
            svc, "SELECT worker FROM task_attempts WHERE task_id = :id", id=killed["task_id"]
        )
        [holder] = [w for w in workers if owner.startswith(f"{w.node}:")]
        holder.killpg(signal.SIGKILL)
        state = await _ended(svc, killed["id"], within=30)
        assert (state["status"], state["task_status"], state["task_error"]["code"]) == (
            "failed",
            "failed",
            "lease_expired",
        )
        assert state["item_count"] == CHUNKS and "resume" in state["error_message"]
        assert_distinct(await items(svc, killed["id"]), CHUNKS)

        # A third worker warms up meanwhile: the shutdown below needs a survivor too.
        workers.append(cluster.start_worker("worker3", concurrency=2, **env))

        # -- cancel of a running generation
        await asyncio.to_thread(entered.unlink)
        r = await client.post("/evaluation/datasets", json={"base_id": base, "size": SIZE}, headers=ALICE)
        cancelled = r.json()
        await wait_for(held, within=60, what="the second generation to be held")
        r = await client.post(f"/tasks/{cancelled['task_id']}/cancel", headers=ALICE)
        assert r.status_code == 202, r.text
        state = await _ended(svc, cancelled["id"], within=30)
        assert (state["status"], state["task_status"], state["item_count"]) == (
            "cancelled",
            "cancelled",
            CHUNKS,
        )
        assert_distinct(await items(svc, cancelled["id"]), CHUNKS)

        # -- worker shutdown (SIGTERM to the main process, as a supervisor sends it)
        await cluster.wait_worker_ready(workers[-1])
        await asyncio.to_thread(entered.unlink)
        r = await client.post("/evaluation/datasets", json={"base_id": base, "size": SIZE}, headers=ALICE)
        shut = r.json()
        await wait_for(held, within=60, what="the third generation to be held")
        owner = await scalar(svc, "SELECT worker FROM task_attempts WHERE task_id = :id", id=shut["task_id"])
        [holder] = [w for w in workers if owner.startswith(f"{w.node}:")]
        holder.send(signal.SIGTERM)
        state = await _ended(svc, shut["id"], within=30)
        assert (state["status"], state["task_error"]["code"], state["item_count"]) == (
            "failed",
            "worker_shutdown",
            CHUNKS,
        )

        # -- resume all three: each ends with exactly its target, no item twice
        await asyncio.to_thread(gate.unlink)
        for dataset in (killed, cancelled, shut):
            r = await client.post(f"/evaluation/datasets/{dataset['id']}/resume", headers=ALICE)
            assert r.status_code == 202, r.text
            dataset["resumed_by"] = r.json()["task_id"]
        for dataset in (killed, cancelled, shut):
            state = await _ended(svc, dataset["id"], within=60)
            assert (state["status"], state["task_status"], state["item_count"]) == (
                "completed",
                "success",
                SIZE,
            )
            stored = await items(svc, dataset["id"])
            assert_distinct(stored, SIZE)
            # The first items are the interrupted attempt's, kept as they were committed.
            assert len({i["attempt_token"] for i in stored[:CHUNKS]}) == 1
            assert stored[0]["attempt_token"] != stored[-1]["attempt_token"]

        # -- an evaluation run on a worker
        r = await client.post(
            "/evaluation/runs", json={"dataset_id": killed["id"], "base_id": base, "top_k": 3}, headers=ALICE
        )
        assert r.status_code == 202, r.text
        run_id = r.json()["id"]

        async def run_done() -> dict[str, Any] | None:
            run = (await client.get(f"/evaluation/runs/{run_id}", headers=ALICE)).json()
            return run if run["status"] != "running" else None

        run = await wait_for(run_done, within=60, interval=0.2, what="the evaluation run")
        assert run["status"] == "completed", run
        assert run["progress"]["done"] == SIZE and run["metrics"]["items"] == SIZE
        assert run["metrics"]["hit_rate"] >= 0.9, run  # each question quotes its own document's words
