"""Claim: one atomic move pending -> running, under real concurrent PostgreSQL sessions."""

from __future__ import annotations

import asyncio
import random
import uuid
from datetime import timedelta
from typing import Any

from hooks_for_tests import registry_with_test_specs
from repo_helpers import (
    at,
    attempt_rows,
    claim,
    db_now,
    insert_raw,
    scalar,
    submit,
    task_row,
)
from sqlalchemy import text

from tasks_core.db import make_engine
from tasks_core.model import Status
from tasks_core.store.facade import TaskStore
from tasks_core.store.outcomes import Claim

CLAIMERS = 20


async def _warm_pool(repo: TaskStore, n: int) -> None:
    """Open n connections up front so the race is between live sessions, not connection set-up."""
    conns = [await repo.engine.connect() for _ in range(n)]
    for conn in conns:
        await conn.close()


async def _race(coros: list[Any]) -> list[Any]:
    """Start every coroutine at the same instant (after all are scheduled) and gather them."""
    gate = asyncio.Event()

    async def gated(coro: Any) -> Any:
        await gate.wait()
        return await coro

    tasks = [asyncio.ensure_future(gated(c)) for c in coros]
    await asyncio.sleep(0)
    gate.set()
    return await asyncio.gather(*tasks)


async def test_twenty_sessions_racing_for_one_row_yield_exactly_one_owner(
    services: Any, database_url: str
) -> None:
    """I1: of 20 concurrent claims of one pending row exactly one wins, under one token, and the
    attempts audit holds exactly one row for it; everyone else is refused as `not_pending:running`."""
    engine = make_engine(database_url, pool_size=CLAIMERS)
    repo = TaskStore(engine)
    try:
        await _warm_pool(repo, CLAIMERS)
        for _round in range(3):
            task_id = await submit(repo)
            results = await _race(
                [
                    repo.claim(task_id, services.registry, capacity=100, lease_seconds=30, worker=f"w{i}")
                    for i in range(CLAIMERS)
                ]
            )
            wins = [r for r in results if isinstance(r, Claim)]
            assert len(wins) == 1, results
            assert sorted(set(r for r in results if not isinstance(r, Claim))) == ["not_pending:running"]

            row = await task_row(engine, task_id)
            assert row["status"] == "running"
            assert row["attempt_token"] == wins[0].token
            assert row["attempt_count"] == 1
            attempts = await attempt_rows(engine, task_id)
            assert len(attempts) == 1
            assert attempts[0]["token"] == wins[0].token
            assert attempts[0]["attempt"] == 1 and attempts[0]["ended_at"] is None
            assert attempts[0]["worker"] == f"w{results.index(wins[0])}"
    finally:
        await engine.dispose()


async def test_duplicate_delivery_of_one_id_makes_one_attempt(services: Any) -> None:
    """I1: the broker may deliver an id twice; the second claim is refused and records nothing."""
    repo, reg = services.repo, services.registry
    task_id = await submit(repo)
    first = await claim(repo, reg, task_id)
    again = await repo.claim(task_id, reg, capacity=4, lease_seconds=30, worker="worker-b")
    assert again == "not_pending:running"
    attempts = await attempt_rows(repo.engine, task_id)
    assert [(a["attempt"], a["token"], a["worker"]) for a in attempts] == [(1, first.token, "worker-a")]
    assert (await task_row(repo.engine, task_id))["attempt_token"] == first.token


async def test_claim_sets_the_lease_from_the_database_clock(services: Any) -> None:
    """I7: the lease is `now + lease_seconds` on PostgreSQL's clock (pinned here), not the worker's."""
    pinned = (await db_now(services.engine)) - timedelta(days=3)
    repo = at(services.engine, pinned)
    task_id = await submit(repo)
    got = await claim(repo, services.registry, task_id, lease=12.5)
    row = await task_row(services.engine, task_id)
    assert row["lease_expires_at"] == pinned + timedelta(seconds=12.5)
    assert row["started_at"] == row["heartbeat_at"] == pinned
    assert got.task["lease_expires_at"] == row["lease_expires_at"]
    assert (await attempt_rows(services.engine, task_id))[0]["claimed_at"] == pinned


async def test_claim_refuses_with_a_reason_and_writes_nothing(services: Any) -> None:
    """Every refusal names its reason, leaves the row as it was and records no attempt; a refusal
    that drops a message for a claimable task (capacity, backoff) only clears its publication stamp,
    so the relay re-sends it."""
    repo, reg, engine = services.repo, services.registry, services.engine
    now = await db_now(engine)

    async def exists(task_id: uuid.UUID) -> bool:
        return bool(await scalar(engine, "SELECT count(*) FROM tasks WHERE id = :id", id=task_id))

    async def refused(task_id: uuid.UUID, *, capacity: int = 4) -> str:
        before = await task_row(engine, task_id) if await exists(task_id) else None
        got = await repo.claim(task_id, reg, capacity=capacity, lease_seconds=30, worker="late")
        assert isinstance(got, str), f"unexpectedly claimed {task_id}"
        if before is not None:
            after = await task_row(engine, task_id)
            if got in ("capacity_full", "backoff"):
                assert after.pop("last_published_at") is None
                before.pop("last_published_at")
            assert after == before
            assert all(a["worker"] != "late" for a in await attempt_rows(engine, task_id))
        return got

    assert await refused(uuid.uuid4()) == "unknown_task"

    running = await submit(repo)
    await claim(repo, reg, running)
    assert await refused(running) == "not_pending:running"

    finished = await submit(repo)
    done = await claim(repo, reg, finished)
    await repo.finish(finished, done.token, reg, status=Status.SUCCESS, result={"ok": True})
    assert await refused(finished) == "not_pending:success"

    cancelled = await submit(repo)
    assert await repo.request_cancel(cancelled, reg) == "cancelled"
    assert await refused(cancelled) == "not_pending:cancelled"

    # A pending row carrying cancel intent (e.g. kept by the upgrade, or a shutdown hand-back).
    intent = await insert_raw(engine, cancel_requested_at=now)
    assert await refused(intent) == "cancel_requested"

    newer = await insert_raw(engine, version=99)
    legacy = await insert_raw(engine, version=0)
    unknown_type = await insert_raw(engine, task_type="no.such.type")
    for task_id in (newer, legacy, unknown_type):
        assert await refused(task_id) == "not_runnable"

    backing_off = await insert_raw(engine, not_before=now + timedelta(minutes=5))
    assert await refused(backing_off) == "backoff"
    # ... and the same row is claimable once the database clock passes not_before.
    later = at(engine, now + timedelta(minutes=6))
    assert isinstance(await later.claim(backing_off, reg, capacity=4, lease_seconds=30), Claim)

    # Capacity counts every running row (two so far, including the backoff one just claimed).
    full = await submit(repo)
    assert await scalar(engine, "SELECT count(*) FROM tasks WHERE status = 'running'") == 2
    assert await refused(full, capacity=2) == "capacity_full"
    assert isinstance(await repo.claim(full, reg, capacity=4, lease_seconds=30), Claim)


async def test_per_type_concurrency_cap_holds_under_a_race(services: Any, database_url: str) -> None:
    """I5 per type: a spec's `concurrency=1` admits one running task of that type at a time."""
    reg = registry_with_test_specs()
    engine = make_engine(database_url, pool_size=10)
    repo = TaskStore(engine)
    try:
        ids = [await submit(repo, "test.capped") for _ in range(6)]
        results = await _race([repo.claim(i, reg, capacity=100, lease_seconds=30) for i in ids])
        assert sum(isinstance(r, Claim) for r in results) == 1
        assert sorted(set(r for r in results if not isinstance(r, Claim))) == ["capacity_full"]
        # Other types are not held back by the capped one.
        other = await submit(repo)
        assert isinstance(await repo.claim(other, reg, capacity=100, lease_seconds=30), Claim)
    finally:
        await engine.dispose()


async def test_twenty_claimers_burst_never_exceed_capacity(services: Any, database_url: str) -> None:
    """I5: 10 pending tasks, 20 concurrent claimers (two per task), capacity 4: exactly 4 claims win,
    4 rows run and the attempts audit shows exactly 4 live attempts."""
    engine = make_engine(database_url, pool_size=CLAIMERS)
    repo = TaskStore(engine)
    try:
        await _warm_pool(repo, CLAIMERS)
        ids = [await submit(repo) for _ in range(10)]
        results = await _race(
            [
                repo.claim(ids[i % 10], services.registry, capacity=4, lease_seconds=30, worker=f"w{i}")
                for i in range(CLAIMERS)
            ]
        )
        wins = [r for r in results if isinstance(r, Claim)]
        assert len(wins) == 4
        assert len({w.task["id"] for w in wins}) == 4
        assert set(r for r in results if not isinstance(r, Claim)) <= {"capacity_full", "not_pending:running"}
        assert await scalar(engine, "SELECT count(*) FROM tasks WHERE status = 'running'") == 4
        assert await scalar(engine, "SELECT count(*) FROM task_attempts WHERE ended_at IS NULL") == 4
        assert await scalar(engine, "SELECT count(*) FROM task_attempts") == 4
    finally:
        await engine.dispose()


async def test_capacity_holds_while_twenty_claimers_churn_through_ten_tasks(
    services: Any, database_url: str
) -> None:
    """I5 over time: claimers keep claiming and finishing until all 10 tasks are done. A sampler
    never sees more than 4 running rows, and the attempts audit (claimed_at..ended_at intervals,
    all stamped by PostgreSQL) never overlaps more than 4 deep."""
    engine = make_engine(database_url, pool_size=CLAIMERS + 2)
    repo, reg = TaskStore(engine), services.registry
    capacity = 4
    try:
        await _warm_pool(repo, CLAIMERS + 1)
        ids = [await submit(repo) for _ in range(10)]
        done: set[uuid.UUID] = set()
        samples: list[int] = []
        stop = asyncio.Event()

        async def claimer(i: int) -> None:
            rng = random.Random(i)
            while len(done) < len(ids):
                task_id = rng.choice([t for t in ids if t not in done] or ids)
                got = await repo.claim(task_id, reg, capacity=capacity, lease_seconds=30, worker=f"w{i}")
                if isinstance(got, Claim):
                    await asyncio.sleep(0.01)
                    await repo.finish(task_id, got.token, reg, status=Status.SUCCESS, result={"by": i})
                    done.add(task_id)
                else:
                    await asyncio.sleep(0.002)

        async def sampler() -> None:
            async with engine.connect() as conn:
                while not stop.is_set():
                    samples.append(
                        (
                            await conn.execute(text("SELECT count(*) FROM tasks WHERE status = 'running'"))
                        ).scalar()
                    )
                    await conn.rollback()
                    await asyncio.sleep(0.001)

        watcher = asyncio.create_task(sampler())
        await asyncio.wait_for(asyncio.gather(*(claimer(i) for i in range(CLAIMERS))), timeout=30)
        stop.set()
        await watcher

        assert samples and max(samples) <= capacity
        assert await scalar(engine, "SELECT count(*) FROM tasks WHERE status = 'success'") == 10
        async with engine.connect() as conn:
            spans = (await conn.execute(text("SELECT claimed_at, ended_at FROM task_attempts"))).all()
        assert len(spans) == 10  # one attempt per task: no claim ever won twice
        # Sweep: at equal instants an end is counted before a start.
        events = sorted(
            [(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda ev: (ev[0], ev[1])
        )
        depth = peak = 0
        for _, step in events:
            depth += step
            peak = max(peak, depth)
        assert peak <= capacity
    finally:
        await engine.dispose()


async def test_a_slot_left_held_behind_the_runtimes_back_is_reclaimed(services: Any) -> None:
    """Every write that ends an attempt frees its capacity slot in the same statement; a slot left
    held by a change made outside the runtime (a row rewritten by hand, a truncated table) is
    found and freed by the next claim that would otherwise be refused, and by the reconciler."""
    repo, reg = services.repo, services.registry
    first, second, third = [await submit(repo) for _ in range(3)]
    assert isinstance(await repo.claim(first, reg, capacity=1, lease_seconds=30), Claim)
    async with services.engine.begin() as conn:  # "by hand": ended without the runtime
        await conn.execute(
            text(
                """UPDATE tasks SET status = 'failed', attempt_token = NULL, lease_expires_at = NULL
                WHERE id = :id"""
            ),
            {"id": first},
        )
    assert isinstance(await repo.claim(second, reg, capacity=1, lease_seconds=30), Claim)
    async with services.engine.begin() as conn:
        await conn.execute(text("DELETE FROM tasks WHERE id = :id"), {"id": second})
    report = await repo.reconcile(reg, batch=10, retry_delay=lambda n: 0)
    assert report.slots_freed == 1
    assert isinstance(await repo.claim(third, reg, capacity=1, lease_seconds=30), Claim)


async def test_a_hot_statement_whose_backend_was_terminated_runs_again_on_a_fresh_connection(
    services: Any,
) -> None:
    """Hot statements take their connection straight from the pool: a backend terminated under it
    fails the call as transient at most once (the retry's business), and no dead connection stays
    pooled."""
    import asyncpg

    from tasks_core.db import is_transient
    from tasks_core.store.execute import Statement

    repo = services.repo
    whose = Statement(text("SELECT pg_backend_pid() AS pid, CAST(:n AS int) AS n"))
    first = (await repo._fetch(whose, {"n": 1}))[0]["pid"]
    other = await asyncpg.connect(services.settings.database_url.replace("+asyncpg", ""))
    try:
        assert await other.fetchval("SELECT pg_terminate_backend($1)", first)
    finally:
        await other.close()
    failures = 0
    pids = []
    for n in range(6):
        try:
            pids.append((await repo._fetch(whose, {"n": n}))[0]["pid"])
        except Exception as exc:
            assert is_transient(exc), exc
            failures += 1
    assert failures <= 1 and len(pids) >= 5
    assert first not in pids
