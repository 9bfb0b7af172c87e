"""The knowledge graph on the real database: /graph routes through the real app, graph.build run
as a worker runs it (claim, handler, terminal transaction with hooks), and its fences driven by
hand: a stale attempt's write is refused, a retry resumes from the checkpoint and ends with exactly
the clean graph, attempts are bounded, and a build never outlives its task (I6)."""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from domains.graph import store
from domains.graph.extraction import SMALL_BASE_CHUNKS, count_chunks, load_extractor
from domains.graph.handlers import _batch_writer
from domains.graph.tasks import MAX_ATTEMPTS
from tasks_core.store.outcomes import OwnershipLost
from tasks_core.worker.context import TaskContext
from tasks_core.worker.runtime import ShutdownSignal, run_task
from tests.graph_helpers import build_row, corpus, expected_tables, graph_tables, make_base
from tests.knowledge_helpers import ALICE, BOB, ROOT, knowledge_api, run_pending, scalar

pytestmark = pytest.mark.usefixtures("clean_db")
# The name a build records for the default extractor (what a worker's handler takes over with).
DEFAULT_NAME = load_extractor("capitalised").name

SMALL = [
    ["Then Ada met Bob and Ada again, near Cyd.", "Then Bob met Ada."],  # Ada x3, Bob x2, Cyd
    ["Then Dee sat alone."],
]


async def _build(client: Any, base: str, headers: dict[str, str] = ALICE) -> dict[str, Any]:
    r = await client.post(f"/graph/{base}/build", headers=headers)
    assert r.status_code == 202, r.text
    body: dict[str, Any] = r.json()
    return body


async def _attempt(svc: Any, task_id: uuid.UUID) -> TaskContext:
    claim = await svc.repo.claim(task_id, svc.registry, capacity=10, lease_seconds=30)
    assert not isinstance(claim, str), claim
    return TaskContext(svc.repo, dict(claim.task), claim.token, claim.attempt)


async def _expire_and_reconcile(svc: Any, task_id: uuid.UUID) -> Any:
    async with svc.engine.begin() as conn:
        await conn.execute(
            text("UPDATE tasks SET lease_expires_at = clock_timestamp() - interval '1 s' WHERE id = :id"),
            {"id": task_id},
        )
    return await svc.repo.reconcile(svc.registry, batch=10, retry_delay=lambda n: 0.0)


async def _one_batch(ctx: TaskContext, base: str, n: int) -> int:
    """What the handler does for its first batch, as attempt ``ctx``: the chunks it counted."""
    async with ctx.owning_transaction() as conn:
        row = await store.take_over(conn, ctx.task_id, ctx.attempt_token, DEFAULT_NAME)
        assert row is not None
        pos = None if row["cursor_file"] is None else (row["cursor_file"], row["cursor_seq"])
        chunks = await store.chunks_after(conn, base, pos, n)
    counts = count_chunks(load_extractor("capitalised"), [c[2] for c in chunks])
    write = _batch_writer(
        row["id"], ctx.attempt_token, pos, (chunks[-1][0], chunks[-1][1]), len(chunks), counts
    )
    assert await ctx.run_in_owning_transaction(write)
    return len(chunks)


async def test_a_built_graph_has_the_counts_and_weights_computed_by_hand() -> None:
    async with knowledge_api() as (client, svc):
        base, _ = await make_base(svc, SMALL)
        # A file that did not reach `indexed` is not part of the graph.
        async with svc.engine.begin() as conn:
            from tests.graph_helpers import add_file

            await add_file(conn, base, uuid.uuid4().hex, ["Then Zed met Ada."], "error_indexing")
        ref = await _build(client, base)
        assert ref["status"] == "building" and ref["deduplicated"] is False
        assert await run_pending(svc) == ["success"]

        g = (await client.get(f"/graph/{base}", headers=ALICE)).json()
        assert g["graph"]["id"] == ref["build_id"] == g["latest"]["id"]
        assert (g["graph"]["status"], g["graph"]["entity_count"], g["graph"]["edge_count"]) == ("built", 4, 3)
        assert (g["graph"]["chunks_done"], g["graph"]["chunk_total"]) == (3, 3)

        page = (await client.get(f"/graph/{base}/entities", headers=ALICE)).json()
        assert page["items"] == [
            {"name": "Ada", "mentions": 3, "chunks": 2},
            {"name": "Bob", "mentions": 2, "chunks": 2},
            {"name": "Cyd", "mentions": 1, "chunks": 1},
            {"name": "Dee", "mentions": 1, "chunks": 1},
        ]
        assert page["next_cursor"] is None
        n = (await client.get(f"/graph/{base}/neighbors", params={"entity": "Ada"}, headers=ALICE)).json()
        assert n["entity"] == {"name": "Ada", "mentions": 3, "chunks": 2}
        assert n["neighbors"] == [
            {"name": "Bob", "weight": 2, "mentions": 2},
            {"name": "Cyd", "weight": 1, "mentions": 1},
        ]
        n = (await client.get(f"/graph/{base}/neighbors", params={"entity": "Cyd"}, headers=ALICE)).json()
        assert [(x["name"], x["weight"]) for x in n["neighbors"]] == [("Ada", 1), ("Bob", 1)]
        n = (await client.get(f"/graph/{base}/neighbors", params={"entity": "Dee"}, headers=ALICE)).json()
        assert n["neighbors"] == []
        # An admin key sees every owner's graph.
        assert (await client.get(f"/graph/{base}/entities", headers=ROOT)).status_code == 200


async def test_entity_pages_walk_the_whole_graph_once_and_a_rebuild_replaces_it_only_when_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DTASK_GRAPH_BATCH_CHUNKS", "7")
    files = corpus(files=4, chunks_per_file=9)
    async with knowledge_api() as (client, svc):
        base, _ = await make_base(svc, files)
        first = await _build(client, base)
        assert await run_pending(svc) == ["success"]
        entities, edges = expected_tables([t for f in files for t in f])
        assert await graph_tables(svc, uuid.UUID(first["build_id"])) == (entities, edges)

        seen: list[dict[str, Any]] = []
        cursor = None
        while True:
            params: dict[str, Any] = {"limit": 3, **({"cursor": cursor} if cursor else {})}
            page = (await client.get(f"/graph/{base}/entities", params=params, headers=ALICE)).json()
            seen += page["items"]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert len(seen) == len(entities) > 3
        assert {(e["name"], e["mentions"], e["chunks"]) for e in seen} == entities
        assert [(-e["mentions"], e["name"]) for e in seen] == sorted(
            (-e["mentions"], e["name"]) for e in seen
        )

        # A second build: until it succeeds, readers keep seeing the first graph.
        second = await _build(client, base)
        assert second["build_id"] != first["build_id"]
        page = (await client.get(f"/graph/{base}/entities", headers=ALICE)).json()
        assert page["build_id"] == first["build_id"]
        assert await run_pending(svc) == ["success"]
        page = (await client.get(f"/graph/{base}/entities", headers=ALICE)).json()
        assert page["build_id"] == second["build_id"]
        assert await graph_tables(svc, uuid.UUID(second["build_id"])) == (entities, edges)
        # The first build and its rows are gone.
        assert await scalar(svc, "SELECT count(*) FROM graph_builds") == 1
        assert await scalar(svc, "SELECT count(DISTINCT build_id) FROM graph_entities") == 1


async def test_concurrent_build_requests_share_one_build_and_task() -> None:
    async with knowledge_api() as (client, svc):
        base, _ = await make_base(svc, SMALL)
        refs = await asyncio.gather(*(_build(client, base) for _ in range(6)))
        assert len({r["task_id"] for r in refs}) == 1
        assert len({r["build_id"] for r in refs}) == 1
        assert sorted(r["deduplicated"] for r in refs) == [False] + [True] * 5
        assert await scalar(svc, "SELECT count(*) FROM tasks") == 1
        assert await scalar(svc, "SELECT count(*) FROM graph_builds") == 1


def _cursor(value: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")


async def _state(svc: Any) -> tuple[Any, ...]:
    return (
        await scalar(svc, "SELECT count(*) FROM tasks"),
        await scalar(svc, "SELECT count(*) FROM graph_builds"),
        await scalar(svc, "SELECT count(*) FROM graph_entities"),
    )


async def test_bad_input_answers_a_clear_4xx_and_changes_nothing() -> None:
    async with knowledge_api() as (client, svc):
        base, _ = await make_base(svc, SMALL)
        # No graph yet: 404 saying so (not a crash, not an empty page).
        r = await client.get(f"/graph/{base}/entities", headers=ALICE)
        assert r.status_code == 404 and "no graph yet" in r.json()["detail"]
        await _build(client, base)
        assert await run_pending(svc) == ["success"]
        before = await _state(svc)
        unknown = uuid.uuid4().hex
        for method, path, params in [
            ("post", f"/graph/{unknown}/build", {}),
            ("get", f"/graph/{unknown}/entities", {}),
            ("get", f"/graph/{unknown}/neighbors", {"entity": "Ada"}),
            ("get", f"/graph/{base}/neighbors", {"entity": "Nobody"}),
        ]:
            r = await client.request(method, path, params=params, headers=ALICE)
            assert r.status_code == 404, (path, r.text)
            assert r.json()["detail"]
        # Another owner's base does not exist for bob: the same 404 as an unknown one.
        for method, path, params in [
            ("post", f"/graph/{base}/build", {}),
            ("get", f"/graph/{base}", {}),
            ("get", f"/graph/{base}/entities", {}),
            ("get", f"/graph/{base}/neighbors", {"entity": "Ada"}),
        ]:
            r = await client.request(method, path, params=params, headers=BOB)
            assert (r.status_code, r.json()["detail"]) == (404, "no such base"), path
        bad: list[tuple[str, dict[str, Any]]] = [
            (f"/graph/{base}/entities", {"limit": 0}),
            (f"/graph/{base}/entities", {"limit": 1001}),
            (f"/graph/{base}/entities", {"limit": "many"}),
            (f"/graph/{base}/entities", {"cursor": "not a cursor!"}),
            (f"/graph/{base}/entities", {"cursor": "bm90LWpzb24"}),  # base64 of "not-json"
            (f"/graph/{base}/entities", {"cursor": "WzEsMl0"}),  # [1,2]: a name must be text
            (f"/graph/{base}/entities", {"cursor": _cursor([2**40, "Ada"])}),  # past a count's range
            (f"/graph/{base}/entities", {"cursor": _cursor([1, "\ud800"])}),  # a lone surrogate
            (f"/graph/{base}/neighbors", {}),
            (f"/graph/{base}/neighbors", {"entity": ""}),
            (f"/graph/{base}/neighbors", {"entity": "Ada", "limit": 0}),
            ("/graph/NOT-AN-ID/entities", {}),
        ]
        for path, query in bad:
            r = await client.get(path, params=query, headers=ALICE)
            assert r.status_code == 422, (path, query, r.text)
        assert (await client.post(f"/graph/{base}/build")).status_code == 401
        assert await _state(svc) == before


async def test_a_stale_attempt_cannot_write_after_the_retry_took_over_and_the_retry_ends_clean(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DTASK_GRAPH_BATCH_CHUNKS", "4")
    files = corpus(files=3, chunks_per_file=5)
    async with knowledge_api() as (client, svc):
        base, _ = await make_base(svc, files)
        ref = await _build(client, base)
        task_id, build_id = uuid.UUID(ref["task_id"]), uuid.UUID(ref["build_id"])

        # Attempt A counts one batch, then falls silent: its lease lapses and, the handler being
        # retry-safe, the reconciler hands the task back to pending (no hook: the build stays open).
        a = await _attempt(svc, task_id)
        assert await _one_batch(a, base, 4) == 4
        report = await _expire_and_reconcile(svc, task_id)
        assert report.retried == 1
        assert await scalar(svc, "SELECT status FROM tasks WHERE id = :id", id=task_id) == "pending"
        assert (await build_row(svc, build_id))["status"] == "building"

        # Attempt B claims it and takes the build over.
        b = await _attempt(svc, task_id)
        async with b.owning_transaction() as conn:
            assert await store.take_over(conn, task_id, b.attempt_token, DEFAULT_NAME) is not None
        tables = await graph_tables(svc, build_id)

        # A wakes up and writes its next batch: the owning transaction refuses it...
        with pytest.raises(OwnershipLost):
            await _one_batch(a, base, 4)
        # ...and so does the build's own fence, even for a statement outside any owning transaction.
        counts = count_chunks(load_extractor("capitalised"), ["Then Ghost met Phantom."])
        async with svc.engine.begin() as conn:
            row = await build_row(svc, build_id)
            before = (row["cursor_file"], row["cursor_seq"])
            assert not await _batch_writer(build_id, a.attempt_token, before, ("z" * 32, 0), 1, counts)(conn)
        assert await graph_tables(svc, build_id) == tables
        assert (await build_row(svc, build_id))["chunks_done"] == 4

        # B is lost too; the third attempt (run as a worker runs it) resumes at A's checkpoint.
        assert (await _expire_and_reconcile(svc, task_id)).retried == 1
        outcome = await run_task(svc, str(task_id))
        assert outcome.status == "success"
        task = (await client.get(f"/tasks/{task_id}", headers=ALICE)).json()
        assert task["attempt_count"] == MAX_ATTEMPTS
        assert task["result"]["resumed_from"] == 4 and task["result"]["chunks"] == 15
        assert await graph_tables(svc, build_id) == expected_tables([t for f in files for t in f])
        row = await build_row(svc, build_id)
        assert (row["status"], row["chunks_done"], row["chunk_total"]) == ("built", 15, 15)


async def test_a_build_whose_attempts_run_out_fails_and_drops_its_partial_counts() -> None:
    files = corpus(files=2, chunks_per_file=6)
    async with knowledge_api() as (client, svc):
        base, _ = await make_base(svc, files)
        ref = await _build(client, base)
        task_id, build_id = uuid.UUID(ref["task_id"]), uuid.UUID(ref["build_id"])
        for attempt in range(1, MAX_ATTEMPTS + 1):
            ctx = await _attempt(svc, task_id)
            assert ctx.attempt == attempt
            await _one_batch(ctx, base, 2)
            report = await _expire_and_reconcile(svc, task_id)
            assert (report.retried, report.failed) == ((1, 0) if attempt < MAX_ATTEMPTS else (0, 1))
        task = (await client.get(f"/tasks/{task_id}", headers=ALICE)).json()
        assert (task["status"], task["error"]["code"]) == ("failed", "lease_expired")
        # The failure hook ended the build in the same transaction (I6) and dropped its counts.
        row = await build_row(svc, build_id)
        assert row["status"] == "failed" and "lease_expired" in row["error_message"]
        assert row["chunks_done"] == 2 * MAX_ATTEMPTS
        assert await graph_tables(svc, build_id) == (set(), set())
        g = (await client.get(f"/graph/{base}", headers=ALICE)).json()
        assert g["graph"] is None and g["latest"]["status"] == "failed"
        # A new build is accepted (the failed task no longer holds the base's key) and ends clean.
        again = await _build(client, base)
        assert again["deduplicated"] is False and again["task_id"] != ref["task_id"]
        assert await run_pending(svc) == ["success"]
        assert await graph_tables(svc, uuid.UUID(again["build_id"])) == expected_tables(
            [t for f in files for t in f]
        )


async def test_cancelling_a_pending_build_ends_the_build_cancelled_with_its_task() -> None:
    async with knowledge_api() as (client, svc):
        base, _ = await make_base(svc, SMALL)
        ref = await _build(client, base)
        r = await client.post(f"/tasks/{ref['task_id']}/cancel", headers=ALICE)
        assert r.status_code == 200, r.text
        row = await build_row(svc, uuid.UUID(ref["build_id"]))
        assert row["status"] == "cancelled" and row["finished_at"] is not None


async def test_worker_shutdown_hands_the_build_back_and_the_next_run_resumes_at_its_checkpoint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    gate.touch()
    monkeypatch.setenv("DTASK_GRAPH_BATCH_CHUNKS", "3")
    monkeypatch.setenv("DTASK_GRAPH_EXTRACTOR", "tests.graph_extractors:GateExtractor")
    monkeypatch.setenv("DTASK_TEST_GRAPH_GATE", str(gate))
    monkeypatch.setenv("DTASK_TEST_GRAPH_HOLD_AFTER", "6")  # two batches counted, the third held
    files = corpus(files=2, chunks_per_file=7)
    async with knowledge_api() as (client, svc):
        base, _ = await make_base(svc, files)
        ref = await _build(client, base)
        task_id, build_id = uuid.UUID(ref["task_id"]), uuid.UUID(ref["build_id"])
        shutdown = ShutdownSignal()
        run = asyncio.create_task(run_task(svc, str(task_id), shutdown))
        for _ in range(600):  # until the extractor is held (at most 30 s)
            if await asyncio.to_thread(Path(f"{gate}.entered").exists):
                break
            await asyncio.sleep(0.05)
        assert (await build_row(svc, build_id))["chunks_done"] == 6
        # The worker is asked to stop: after its grace period the retry-safe build goes back to
        # pending (no hook, the build stays open) instead of failing.
        shutdown.set()
        assert (await asyncio.wait_for(run, 10)).status == "pending"
        gate.unlink()
        task = (await client.get(f"/tasks/{task_id}", headers=ALICE)).json()
        assert (task["status"], task["attempt_count"]) == ("pending", 1)
        assert (await build_row(svc, build_id))["status"] == "building"

        assert (await run_task(svc, str(task_id))).status == "success"
        task = (await client.get(f"/tasks/{task_id}", headers=ALICE)).json()
        assert task["attempt_count"] == 2 and task["result"]["resumed_from"] == 6
        assert await graph_tables(svc, build_id) == expected_tables([t for f in files for t in f])


async def test_entities_of_a_single_chunk_are_dropped_with_their_edges_unless_the_base_is_small() -> None:
    common = ["Then Ada met Bob."] * (SMALL_BASE_CHUNKS - 1)
    rare = "Then Ada met Zed and Bob."  # Zed: one chunk
    async with knowledge_api() as (client, svc):
        big, _ = await make_base(svc, [[*common, rare]])
        small, _ = await make_base(svc, [[*common[1:], rare]])
        built = [await _build(client, big), await _build(client, small)]
        assert await run_pending(svc) == ["success", "success"]
        n = SMALL_BASE_CHUNKS
        assert await graph_tables(svc, uuid.UUID(built[0]["build_id"])) == (
            {("Ada", n, n), ("Bob", n, n)},
            {("Ada", "Bob", n)},
        )
        row = await build_row(svc, uuid.UUID(built[0]["build_id"]))
        assert (row["entity_count"], row["edge_count"]) == (2, 1)
        m = n - 1  # under SMALL_BASE_CHUNKS: every name stays
        assert await graph_tables(svc, uuid.UUID(built[1]["build_id"])) == (
            {("Ada", m, m), ("Bob", m, m), ("Zed", 1, 1)},
            {("Ada", "Bob", m), ("Ada", "Zed", 1), ("Bob", "Zed", 1)},
        )
        r = await client.get(f"/graph/{big}/neighbors", params={"entity": "Ada"}, headers=ALICE)
        assert [e["name"] for e in r.json()["neighbors"]] == ["Bob"], r.text


async def test_a_chinese_base_gets_chinese_entities() -> None:
    text = "马云在杭州创办了阿里巴巴，后来又在杭州建立了蚂蚁集团。"
    async with knowledge_api() as (client, svc):
        base, _ = await make_base(svc, [[text, "杭州的西湖很有名。马云也喜欢西湖。"]])
        built = await _build(client, base)
        assert await run_pending(svc) == ["success"]
        entities, _ = await graph_tables(svc, uuid.UUID(built["build_id"]))
        assert {("马云", 2, 2), ("杭州", 3, 2), ("西湖", 2, 1)} <= entities
