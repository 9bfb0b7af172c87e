"""/evaluation end to end in one process: the real app, PostgreSQL, Redis, a milvus-lite server and
SeaweedFS S3; tasks are claimed and run by the real runtime (``run_task``), no worker. Fencing is
driven through the repository with hand-made attempts, as a late worker would write."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from sqlalchemy import text

from domains.evaluation import store
from domains.evaluation.handlers import generate_dataset
from domains.evaluation.settings import MAX_DATASET_SIZE, MAX_TOP_K
from tasks_core.model import Status
from tasks_core.store.outcomes import OwnershipLost
from tasks_core.worker.context import TaskContext
from tests.evaluation_helpers import TOPICS, assert_distinct, dataset_row, document, indexed_base, items, rows
from tests.knowledge_helpers import ALICE, BOB, knowledge_api, run_pending, scalar

pytestmark = pytest.mark.usefixtures("clean_db")


async def _attempt(svc: Any, task_id: uuid.UUID | str) -> TaskContext:
    claim = await svc.repo.claim(uuid.UUID(str(task_id)), svc.registry, capacity=10, lease_seconds=30)
    assert not isinstance(claim, str), claim
    return TaskContext(svc.repo, dict(claim.task), claim.token, claim.attempt)


async def _expire_and_reconcile(svc: Any, task_id: uuid.UUID) -> None:
    """The attempt falls silent: its lease lapses by PostgreSQL's clock and the reconciler fails it."""
    async with svc.engine.begin() as conn:
        await conn.execute(
            text("UPDATE tasks SET lease_expires_at = clock_timestamp() - interval '1 s' WHERE id = :id"),
            {"id": task_id},
        )
    report = await svc.repo.reconcile(svc.registry, batch=10, retry_delay=lambda n: 0.0)
    assert report.failed == 1 and report.hook_errors == 0


async def _create(client: Any, base: str, size: int, headers: dict[str, str] = ALICE) -> dict[str, Any]:
    r = await client.post("/evaluation/datasets", json={"base_id": base, "size": size}, headers=headers)
    assert r.status_code == 202, r.text
    body: dict[str, Any] = r.json()
    assert body["status"] == "generating"
    return body


async def test_generate_page_refuse_a_second_resume_and_evaluate(knowledge_stores: dict[str, str]) -> None:
    async with knowledge_api() as (client, svc):
        base, _ = await indexed_base(client, svc, [(f"{t}.txt", document(t)) for t in TOPICS[:4]])
        created = await _create(client, base, 10)
        ds = (await client.get(f"/evaluation/datasets/{created['id']}", headers=ALICE)).json()
        assert (ds["status"], ds["item_count"], ds["target"], ds["task_id"]) == (
            "generating",
            0,
            10,
            created["task_id"],
        )
        assert await run_pending(svc) == ["success"]
        ds = (await client.get(f"/evaluation/datasets/{created['id']}", headers=ALICE)).json()
        assert (ds["status"], ds["item_count"], ds["error_message"], ds["generator"]) == (
            "completed",
            10,
            None,
            "local",
        )
        assert_distinct(await items(svc, created["id"]), 10)

        # Pages of 4: 4 + 4 + 2, in order, each item as stored.
        seen, cursor = [], None
        while True:
            params: dict[str, Any] = {"limit": 4, **({"cursor": cursor} if cursor else {})}
            page = (
                await client.get(f"/evaluation/datasets/{created['id']}/items", params=params, headers=ALICE)
            ).json()
            seen.extend(page["items"])
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert [i["seq"] for i in seen] == list(range(10))
        assert all(i["relevant_chunk_ids"][0] == i["chunk_id"] for i in seen)

        # Resuming a completed dataset changes nothing and says so.
        before = await dataset_row(svc, created["id"])
        tasks_before = await scalar(svc, "SELECT count(*) FROM tasks")
        r = await client.post(f"/evaluation/datasets/{created['id']}/resume", headers=ALICE)
        assert r.status_code == 409 and "already complete" in r.json()["detail"], r.text
        assert await dataset_row(svc, created["id"]) == before
        assert await scalar(svc, "SELECT count(*) FROM tasks") == tasks_before

        r = await client.post(
            "/evaluation/runs", json={"dataset_id": created["id"], "base_id": base, "top_k": 3}, headers=ALICE
        )
        assert r.status_code == 202, r.text
        run_id = r.json()["id"]
        pending = (await client.get(f"/evaluation/runs/{run_id}", headers=ALICE)).json()
        assert (pending["status"], pending["metrics"], pending["progress"]["done"]) == ("running", None, 0)
        assert await run_pending(svc) == ["success"]
        run = (await client.get(f"/evaluation/runs/{run_id}", headers=ALICE)).json()
        assert run["status"] == "completed" and run["progress"] == {"done": 10, "total": 10, "percent": 100.0}
        outcomes = (await client.get(f"/evaluation/runs/{run_id}/items", headers=ALICE)).json()["items"]
        assert [o["seq"] for o in outcomes] == list(range(10))
        assert all(len(o["retrieved_chunk_ids"]) <= 3 for o in outcomes)
        # The metrics are those of the stored outcomes (the exact values: the hand-made test below).
        m = run["metrics"]
        assert m["hit_rate"] == pytest.approx(sum(o["hit"] for o in outcomes) / 10)
        assert m["recall"] == pytest.approx(sum(o["recall"] for o in outcomes) / 10)
        assert m["mrr"] == pytest.approx(sum(1 / o["rank"] for o in outcomes if o["rank"]) / 10)
        # Each question quotes its chunk's words: the lexical embedder finds most of them first.
        assert m["hit_rate"] >= 0.8, outcomes


async def test_metrics_on_a_hand_made_base_and_dataset_equal_the_hand_computed_values(
    knowledge_stores: dict[str, str],
) -> None:
    texts = {
        "a1": "apple banana cherry date",
        "a2": "apple banana cherry date elderberry fig grape honeydew",
        "b1": "kiwi lemon mango nectarine",
        "b2": "kiwi lemon mango nectarine orange papaya quince raspberry",
        "c1": "violin trumpet cello flute",
        "c2": "violin trumpet cello flute oboe harp tuba bassoon",
    }
    async with knowledge_api() as (client, svc):
        base, file_ids = await indexed_base(client, svc, [(f"{k}.txt", v) for k, v in texts.items()])
        chunk = {k: f"{fid}-0" for k, fid in zip(texts, file_ids, strict=True)}  # one chunk per file
        # (question, relevant chunks): with top_k = 2 each question retrieves [its own text's chunk,
        # the longer chunk sharing its words] — asserted below from the stored outcomes.
        hand_made = [
            (texts["a1"], ["a1"]),  # rank 1: hit 1, recall 1, reciprocal rank 1
            (texts["a1"], ["a2"]),  # rank 2: hit 1, recall 1, reciprocal rank 1/2
            (texts["b1"], ["b2", "c1"]),  # rank 2, one of two: hit 1, recall 1/2, rr 1/2
            (texts["c1"], ["a1"]),  # not retrieved: 0, 0, 0
        ]
        dataset_id = uuid.uuid4().hex
        async with svc.engine.begin() as conn:
            await conn.execute(
                text(
                    """INSERT INTO evaluation_datasets (id, owner, base_id, target, item_count, status)
                    VALUES (:id, 'alice', :base, 4, 4, 'completed')"""
                ),
                {"id": dataset_id, "base": base},
            )
            for seq, (question, relevant) in enumerate(hand_made):
                await conn.execute(
                    text(
                        """INSERT INTO evaluation_items (dataset_id, seq, chunk_id, ordinal, question, answer,
                                                         relevant_chunk_ids)
                        VALUES (:ds, :seq, :chunk, :seq, :q, :q, :rel)"""
                    ),
                    {
                        "ds": dataset_id,
                        "seq": seq,
                        "chunk": chunk[relevant[0]],
                        "q": question,
                        "rel": [chunk[k] for k in relevant],
                    },
                )
        r = await client.post(
            "/evaluation/runs", json={"dataset_id": dataset_id, "base_id": base, "top_k": 2}, headers=ALICE
        )
        assert r.status_code == 202, r.text
        assert await run_pending(svc) == ["success"]
        run = (await client.get(f"/evaluation/runs/{r.json()['id']}", headers=ALICE)).json()
        outcomes = (await client.get(f"/evaluation/runs/{r.json()['id']}/items", headers=ALICE)).json()[
            "items"
        ]
        assert [o["retrieved_chunk_ids"] for o in outcomes] == [
            [chunk["a1"], chunk["a2"]],
            [chunk["a1"], chunk["a2"]],
            [chunk["b1"], chunk["b2"]],
            [chunk["c1"], chunk["c2"]],
        ]
        assert [(o["hit"], o["rank"], o["recall"]) for o in outcomes] == [
            (True, 1, 1.0),
            (True, 2, 1.0),
            (True, 2, 0.5),
            (False, None, 0.0),
        ]
        assert run["status"] == "completed"
        # hit@2 = 3/4; recall@2 = (1 + 1 + 1/2 + 0)/4; MRR = (1 + 1/2 + 1/2 + 0)/4
        assert run["metrics"]["hit_rate"] == pytest.approx(0.75)
        assert run["metrics"]["recall"] == pytest.approx(0.625)
        assert run["metrics"]["mrr"] == pytest.approx(0.5)
        assert (run["metrics"]["items"], run["metrics"]["top_k"]) == (4, 2)


async def test_bad_input_is_refused_and_changes_nothing(knowledge_stores: dict[str, str]) -> None:
    async with knowledge_api() as (client, svc):
        base, _ = await indexed_base(client, svc, [("river.txt", document("river", 1))])
        bob_base, _ = await indexed_base(client, svc, [("orbit.txt", document("orbit", 1))], headers=BOB)
        chunks = await scalar(
            svc,
            "SELECT count(*) FROM knowledge_chunks c JOIN knowledge_files f USING (file_id) WHERE kb_id = :b",
            b=base,
        )
        done = await _create(client, base, 2)
        assert await run_pending(svc) == ["success"]

        async def counts() -> tuple[int, ...]:
            return tuple(
                [
                    await scalar(svc, f"SELECT count(*) FROM {table}")
                    for table in ("tasks", "evaluation_datasets", "evaluation_items", "evaluation_runs")
                ]
            )

        before = await counts()
        unknown = uuid.uuid4().hex
        bad: list[tuple[str, str, dict[str, Any] | None, dict[str, str], int, str]] = [
            ("post", "/evaluation/datasets", {"base_id": unknown, "size": 1}, ALICE, 404, "no such base"),
            ("post", "/evaluation/datasets", {"base_id": bob_base, "size": 1}, ALICE, 404, "no such base"),
            ("post", "/evaluation/datasets", {"base_id": base, "size": 0}, ALICE, 422, "size"),
            ("post", "/evaluation/datasets", {"base_id": base, "size": -3}, ALICE, 422, "size"),
            (
                "post",
                "/evaluation/datasets",
                {"base_id": base, "size": MAX_DATASET_SIZE + 1},
                ALICE,
                422,
                "size",
            ),
            (
                "post",
                "/evaluation/datasets",
                {"base_id": base, "size": 4 * chunks + 1},
                ALICE,
                422,
                "give at most",
            ),
            ("post", "/evaluation/datasets", {"base_id": "not-an-id", "size": 1}, ALICE, 422, "base_id"),
            ("get", f"/evaluation/datasets/{unknown}", None, ALICE, 404, "no such dataset"),
            ("get", f"/evaluation/datasets/{done['id']}", None, BOB, 404, "no such dataset"),
            ("get", f"/evaluation/datasets/{done['id']}/items", None, BOB, 404, "no such dataset"),
            ("post", f"/evaluation/datasets/{done['id']}/resume", None, BOB, 404, "no such dataset"),
            ("post", f"/evaluation/datasets/{unknown}/resume", None, ALICE, 404, "no such dataset"),
            (
                "post",
                "/evaluation/runs",
                {"dataset_id": done["id"], "base_id": base, "top_k": 0},
                ALICE,
                422,
                "top_k",
            ),
            (
                "post",
                "/evaluation/runs",
                {"dataset_id": done["id"], "base_id": base, "top_k": MAX_TOP_K + 1},
                ALICE,
                422,
                "top_k",
            ),
            (
                "post",
                "/evaluation/runs",
                {"dataset_id": unknown, "base_id": base, "top_k": 3},
                ALICE,
                404,
                "dataset",
            ),
            (
                "post",
                "/evaluation/runs",
                {"dataset_id": done["id"], "base_id": base, "top_k": 3},
                BOB,
                404,
                "dataset",
            ),
            (
                "post",
                "/evaluation/runs",
                {"dataset_id": done["id"], "base_id": bob_base, "top_k": 3},
                ALICE,
                404,
                "no such base",
            ),
            ("get", f"/evaluation/runs/{unknown}", None, ALICE, 404, "no such run"),
        ]
        for method, path, body, headers, status, words in bad:
            r = await client.request(method, path, json=body, headers=headers)
            assert r.status_code == status, (path, body, r.text)
            assert words in r.text, (path, body, r.text)
        assert await counts() == before

        # Another owner's run is not there for you either; and a generating dataset cannot be run.
        r = await client.post(
            "/evaluation/runs", json={"dataset_id": done["id"], "base_id": base, "top_k": 1}, headers=ALICE
        )
        run_id = r.json()["id"]
        assert (await client.get(f"/evaluation/runs/{run_id}", headers=BOB)).status_code == 404
        assert (await client.get(f"/evaluation/runs/{run_id}/items", headers=BOB)).status_code == 404
        generating = await _create(client, base, 1)
        r = await client.post(
            "/evaluation/runs",
            json={"dataset_id": generating["id"], "base_id": base, "top_k": 1},
            headers=ALICE,
        )
        assert r.status_code == 409 and r.json()["task_id"] == generating["task_id"], r.text


async def test_an_old_attempt_cannot_write_after_the_resumes_claim(
    knowledge_stores: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DTASK_EVAL_BATCH_SIZE", "2")
    async with knowledge_api() as (client, svc):
        base, _ = await indexed_base(client, svc, [(f"{t}.txt", document(t)) for t in TOPICS[:3]])
        created = await _create(client, base, 6)
        a = await _attempt(svc, created["task_id"])
        async with a.owning_transaction() as conn:
            assert await store.claim_dataset(conn, created["id"], a.task_id, a.attempt_token, "local")
        batch = [
            {
                "chunk_id": f"c{i}",
                "ordinal": 0,
                "question": "q",
                "answer": "a",
                "relevant_chunk_ids": [f"c{i}"],
            }
            for i in range(4)
        ]
        async with a.owning_transaction() as conn:
            assert await store.add_items(conn, created["id"], a.task_id, a.attempt_token, batch[:2]) == 2

        # A's lease lapses; the reconciler fails its task and the hook fails the dataset, items kept.
        await _expire_and_reconcile(svc, a.task_id)
        ds = (await client.get(f"/evaluation/datasets/{created['id']}", headers=ALICE)).json()
        assert (ds["status"], ds["item_count"]) == ("failed", 2)
        assert "lease_expired" in ds["error_message"]

        # The user resumes; the new task's attempt B claims the dataset.
        r = await client.post(f"/evaluation/datasets/{created['id']}/resume", headers=ALICE)
        assert r.status_code == 202, r.text
        assert r.json()["task_id"] != created["task_id"]
        b = await _attempt(svc, r.json()["task_id"])
        async with b.owning_transaction() as conn:
            assert await store.claim_dataset(conn, created["id"], b.task_id, b.attempt_token, "local")

        # A wakes up: its owning transaction is refused, and so is the dataset's own fence even
        # for a statement outside any owning transaction.
        with pytest.raises(OwnershipLost):
            async with a.owning_transaction() as conn:
                await store.add_items(conn, created["id"], a.task_id, a.attempt_token, batch[2:])
        async with svc.engine.begin() as conn:
            assert await store.add_items(conn, created["id"], a.task_id, a.attempt_token, batch[2:]) is None
        with pytest.raises(OwnershipLost):
            await generate_dataset(a)
        assert len(await items(svc, created["id"])) == 2

        # B runs its handler to the end and finishes: exactly the target, no duplicates, the first
        # two items still A's (committed while A owned the dataset).
        result = await generate_dataset(b)
        assert result["item_count"] == 6
        assert (
            await svc.repo.finish(b.task_id, b.attempt_token, svc.registry, status=Status.SUCCESS)
            == Status.SUCCESS
        )
        ds = (await client.get(f"/evaluation/datasets/{created['id']}", headers=ALICE)).json()
        assert (ds["status"], ds["item_count"], ds["task_id"]) == ("completed", 6, str(b.task_id))
        stored = await items(svc, created["id"])
        assert_distinct(stored, 6)
        assert [i["attempt_token"] for i in stored] == [a.attempt_token] * 2 + [b.attempt_token] * 4


async def test_an_expired_owner_cannot_mark_the_dataset_completed(knowledge_stores: dict[str, str]) -> None:
    async with knowledge_api() as (client, svc):
        base, _ = await indexed_base(client, svc, [(f"{t}.txt", document(t)) for t in TOPICS[:2]])
        created = await _create(client, base, 4)
        a = await _attempt(svc, created["task_id"])
        assert (await generate_dataset(a))["item_count"] == 4  # every item written while A owned it

        # Before A's success commits, its lease lapses (PostgreSQL's clock): the success and its
        # hook (the only way to `completed`) are refused together.
        async with svc.engine.begin() as conn:
            await conn.execute(
                text("UPDATE tasks SET lease_expires_at = clock_timestamp() - interval '1 s' WHERE id = :id"),
                {"id": a.task_id},
            )
        with pytest.raises(OwnershipLost):
            await svc.repo.finish(a.task_id, a.attempt_token, svc.registry, status=Status.SUCCESS)
        row = await dataset_row(svc, created["id"])
        assert (row["status"], row["item_count"]) == ("generating", 4)
        assert await scalar(svc, "SELECT status FROM tasks WHERE id = :id", id=a.task_id) == "running"

        report = await svc.repo.reconcile(svc.registry, batch=10, retry_delay=lambda n: 0.0)
        assert report.failed == 1
        row = await dataset_row(svc, created["id"])
        assert (row["status"], row["item_count"]) == ("failed", 4)

        # A resume has nothing left to generate: its task succeeds and completes the dataset.
        r = await client.post(f"/evaluation/datasets/{created['id']}/resume", headers=ALICE)
        assert r.status_code == 202, r.text
        assert await run_pending(svc) == ["success"]
        row = await dataset_row(svc, created["id"])
        assert (row["status"], row["item_count"], str(row["task_id"])) == (
            "completed",
            4,
            r.json()["task_id"],
        )
        assert_distinct(await items(svc, created["id"]), 4)


async def test_concurrent_resumes_share_one_task(knowledge_stores: dict[str, str]) -> None:
    async with knowledge_api() as (client, svc):
        base, _ = await indexed_base(client, svc, [("river.txt", document("river"))])
        created = await _create(client, base, 3)
        r = await client.post(f"/tasks/{created['task_id']}/cancel", headers=ALICE)
        assert r.status_code == 200, r.text  # pending: cancelled at once, with its hook
        ds = (await client.get(f"/evaluation/datasets/{created['id']}", headers=ALICE)).json()
        assert (ds["status"], ds["item_count"]) == ("cancelled", 0)

        answers = await asyncio.gather(
            *(client.post(f"/evaluation/datasets/{created['id']}/resume", headers=ALICE) for _ in range(6))
        )
        accepted = [a.json() for a in answers if a.status_code == 202]
        assert len(accepted) == 1, [(a.status_code, a.text) for a in answers]
        task_id = accepted[0]["task_id"]
        assert all(
            a.status_code == 409 and a.json()["task_id"] == task_id for a in answers if a.status_code != 202
        )
        assert await scalar(svc, "SELECT count(*) FROM tasks WHERE status = 'pending'") == 1
        assert await run_pending(svc) == ["success"]
        ds = (await client.get(f"/evaluation/datasets/{created['id']}", headers=ALICE)).json()
        assert (ds["status"], ds["item_count"], ds["task_id"]) == ("completed", 3, task_id)
        assert await rows(svc, "SELECT 1 FROM evaluation_items WHERE dataset_id = :id", id=created["id"])


async def test_a_runs_status_converges_with_its_tasks(knowledge_stores: dict[str, str]) -> None:
    async with knowledge_api() as (client, svc):
        base, _ = await indexed_base(client, svc, [("river.txt", document("river"))])
        dataset = await _create(client, base, 2)
        assert await run_pending(svc) == ["success"]

        async def new_run() -> dict[str, Any]:
            r = await client.post(
                "/evaluation/runs",
                json={"dataset_id": dataset["id"], "base_id": base, "top_k": 2},
                headers=ALICE,
            )
            assert r.status_code == 202, r.text
            body: dict[str, Any] = r.json()
            return body

        async def run_state(run: dict[str, Any]) -> tuple[str, str, str | None]:
            got = (await client.get(f"/evaluation/runs/{run['id']}", headers=ALICE)).json()
            task = (await client.get(f"/tasks/{run['task_id']}", headers=ALICE)).json()
            return got["status"], task["status"], got["error_message"]

        # Cancelled while pending: at once, with its hook.
        cancelled = await new_run()
        assert (await client.post(f"/tasks/{cancelled['task_id']}/cancel", headers=ALICE)).status_code == 200
        assert (await run_state(cancelled))[:2] == ("cancelled", "cancelled")

        # Its attempt lost (lease expired, found by the reconciler).
        lost = await new_run()
        attempt = await _attempt(svc, lost["task_id"])
        await _expire_and_reconcile(svc, attempt.task_id)
        status, task_status, error = await run_state(lost)
        assert (status, task_status) == ("failed", "failed") and "lease_expired" in (error or "")

        # Past its timeout (a millisecond: the runtime stops it at its first await).
        timed_out = await new_run()
        async with svc.engine.begin() as conn:
            await conn.execute(
                text("UPDATE tasks SET timeout_seconds = 0.001 WHERE id = :id"), {"id": timed_out["task_id"]}
            )
        assert await run_pending(svc) == ["failed"]
        status, task_status, error = await run_state(timed_out)
        assert (status, task_status) == ("failed", "failed") and "timeout" in (error or "")

        # The handler fails: the base's vectors are of another embedder than this worker's.
        failing = await new_run()
        async with svc.engine.begin() as conn:
            await conn.execute(
                text("UPDATE knowledge_bases SET embedder = 'other-7' WHERE id = :id"), {"id": base}
            )
        assert await run_pending(svc) == ["failed"]
        status, task_status, error = await run_state(failing)
        assert (status, task_status) == ("failed", "failed") and "other-7" in (error or "")
        assert (await client.get(f"/evaluation/runs/{failing['id']}", headers=ALICE)).json()[
            "metrics"
        ] is None
