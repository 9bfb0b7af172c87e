"""The api with a store that does not answer (its server SIGSTOPped): knowledge routes that need it
answer 503 within the store deadline, never 500 or a hang; no route that does not need it is held up,
and nothing half-made is left behind. Real milvus-lite and SeaweedFS servers of their own."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tests.knowledge_helpers import ALICE, BOB, create_base, knowledge_api, scalar, upload
from tests.store_faults import FaultyStores

pytestmark = pytest.mark.usefixtures("clean_db")

# The api's store deadline here (DTASK_STORE_TIMEOUT_SECONDS; the tests' lease allows it).
DEADLINE = 1.5
# What an answer may take beyond it: the call's own slack, a thread hand-over, a busy machine.
ANSWER_WITHIN = DEADLINE + 4.0


async def _timed(coro: Any) -> tuple[Any, float]:
    started = time.monotonic()
    result = await coro
    return result, time.monotonic() - started


async def test_with_milvus_stalled_knowledge_routes_answer_503_in_time_and_others_keep_working(
    faulty_stores: FaultyStores,
) -> None:
    async with knowledge_api(store_timeout_seconds=DEADLINE, **faulty_stores.settings()) as (client, svc):
        base = await create_base(client)
        with faulty_stores.paused("milvus"):
            r, took = await _timed(
                client.post(f"/knowledge/bases/{base}/search", json={"query": "x", "top_k": 3}, headers=ALICE)
            )
            assert r.status_code == 503, r.text
            assert "Milvus" in r.json()["detail"] and r.headers["retry-after"]
            assert took < ANSWER_WITHIN
            print(f"search with Milvus stalled: 503 in {took:.2f} s")

            # Sixteen creates at once by one tenant: each answers 503 in time, and while they wait
            # another tenant's routes that need no Milvus answer as usual (no pooled connection is
            # held across a store call).
            creates = [
                client.post("/knowledge/bases", json={"name": f"stalled-{i}"}, headers=ALICE)
                for i in range(16)
            ]
            others = [client.get("/tasks", headers=BOB), client.get("/knowledge/bases", headers=BOB)]
            answers, took = await _timed(asyncio.gather(*creates, *others))
            assert [a.status_code for a in answers[:16]] == [503] * 16, answers[0].text
            assert [a.status_code for a in answers[16:]] == [200, 200]
            assert took < 2 * ANSWER_WITHIN  # sixteen calls share Milvus' eight threads
            print(f"16 creates with Milvus stalled: all 503 in {took:.2f} s, other routes 200")
        # Nothing half-made: the only base is the one created before the stall.
        assert await scalar(svc, "SELECT count(*) FROM knowledge_bases") == 1


async def test_with_s3_stalled_an_upload_answers_503_in_time_and_stores_nothing(
    faulty_stores: FaultyStores,
) -> None:
    async with knowledge_api(store_timeout_seconds=DEADLINE, **faulty_stores.settings()) as (client, svc):
        base = await create_base(client)
        with faulty_stores.paused("s3"):
            r, took = await _timed(upload(client, base, [("a.txt", b"alpha words"), ("b.txt", b"beta")]))
            assert r.status_code == 503, r.text
            assert "S3" in r.json()["detail"]
            assert took < 2 * ANSWER_WITHIN
            print(f"upload with S3 stalled: 503 in {took:.2f} s")
            health = await client.get("/tasks", headers=ALICE)
            assert health.status_code == 200
        assert await scalar(svc, "SELECT count(*) FROM knowledge_files") == 0
        assert await scalar(svc, "SELECT count(*) FROM tasks") == 0


async def test_deleting_a_base_while_its_file_indexes_ends_the_task_cancelled_not_failed(
    knowledge_stores: dict[str, str], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The delete drops the collection under the running ingest: its next Milvus call fails. That
    is the delete's doing, not an outage: the task ends cancelled (the delete asked for it), the
    file is skipped, and no collection comes back for the deleted base."""
    from tasks_core.worker.runtime import run_task
    from tests.knowledge_helpers import milvus_client, paragraphs

    gate = tmp_path / "embed-gate"
    gate.touch()
    monkeypatch.setenv("DTASK_EMBEDDER", "tests.knowledge_embedders:GateEmbedder")
    monkeypatch.setenv("DTASK_TEST_EMBED_GATE", str(gate))
    # A lease long enough that the heartbeat does not see the cancel before the handler meets the
    # dropped collection (the order the delete produced in production).
    async with knowledge_api(lease_seconds=30) as (client, svc):
        base = await create_base(client)
        words = [f"word{i}" for i in range(50)]
        r = await upload(client, base, [("long.md", paragraphs(words, 150).encode())])
        entry = r.json()["files"][0]
        running = asyncio.create_task(run_task(svc, entry["task_id"]))
        for _ in range(600):
            if await asyncio.to_thread((tmp_path / "embed-gate.entered").exists):
                break
            await asyncio.sleep(0.05)
        r = await client.delete(f"/knowledge/bases/{base}", headers=ALICE)
        assert r.status_code == 204, r.text
        gate.unlink()
        outcome = await asyncio.wait_for(running, 60)
        task = (await client.get(f"/tasks/{entry['task_id']}", headers=ALICE)).json()
        assert (outcome.status, task["status"], task["error"]["code"]) == ("cancelled",) * 3, task
        assert not milvus_client(knowledge_stores).has_collection(f"kb_{base}")
