"""Early expiry of a dead process's attempts, by their tokens, on the real PostgreSQL: only the
named running attempts lose their lease, the reconciler then moves them on like a lapsed lease, and
an attempt that ends (or a task claimed afresh) meanwhile is never touched."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from repo_helpers import at, attempt_rows, claim, db_now, start_run_row, submit, task_row

from tasks_core.duties import reconciler
from tasks_core.worker.dead_owners import expire_dead

NODE = "worker-a@host"


async def _running(services: Any, task_type: str, worker: str) -> tuple[Any, Any]:
    task_id = await submit(services.repo, task_type, {"seconds": 60})
    got = await claim(services.repo, services.registry, task_id, worker=worker)
    await start_run_row(services.repo, task_id, got.token)
    return task_id, got


async def test_a_dead_process_attempts_expire_at_once_and_the_reconciler_moves_them_on(
    services: Any,
) -> None:
    repo, engine = services.repo, services.engine
    plain, plain_claim = await _running(services, "diagnostics.sleep", f"{NODE}:101")
    safe, safe_claim = await _running(services, "diagnostics.sleep_retry_safe", f"{NODE}:101")
    alive, alive_claim = await _running(services, "diagnostics.sleep", f"{NODE}:102")
    # Another node whose name only begins like ours: never ours.
    other, _ = await _running(services, "diagnostics.sleep", f"{NODE}2:101")

    mine = [(f"{NODE}:101", plain_claim.token), (f"{NODE}:101", safe_claim.token)]
    assert sorted(await repo.running_attempts_of(NODE)) == sorted([*mine, (f"{NODE}:102", alive_claim.token)])
    before = await db_now(engine)
    expired = await expire_dead(repo, NODE, lambda pid: pid == 101)
    after = await db_now(engine)
    assert sorted(expired) == sorted([plain, safe])
    for task_id in (plain, safe):
        row = await task_row(engine, task_id)
        assert row["status"] == "running" and before <= row["lease_expires_at"] <= after, row
    for task_id in (alive, other):
        row = await task_row(engine, task_id)
        assert (row["lease_expires_at"] - after).total_seconds() > 20, row
    # The dead owner's writes are refused from now on (fenced by the lease).
    assert not (await repo.heartbeat(plain, plain_claim.token, 30)).owned
    # Expiring again changes nothing.
    assert await expire_dead(repo, NODE, lambda pid: pid == 101) == []

    report = await reconciler.reconcile(services)
    assert (report.failed, report.retried) == (1, 1), report
    failed = await task_row(engine, plain)
    assert failed["status"] == "failed" and failed["error"]["code"] == "lease_expired", failed
    pending = await task_row(engine, safe)
    # Back to pending with a backoff (DTASK_RETRY_BACKOFF_SECONDS), not failed.
    assert pending["status"] == "pending" and pending["not_before"] > after, pending
    for task_id in (plain, safe):
        [attempt] = await attempt_rows(engine, task_id)
        assert attempt["outcome"] == "lease_expired" and before <= attempt["ended_at"] <= after, attempt
    assert (await task_row(engine, alive))["status"] == "running"


async def test_an_attempt_that_ends_while_its_expiry_waits_for_the_row_is_untouched(services: Any) -> None:
    """The owner holds the row (an owning transaction) and hands the task back while the expiry of
    its token waits for the lock; once the owner commits, the expiry finds nothing running under that
    token. A new attempt of the same task, under a new token, is not touched either."""
    repo, engine = services.repo, services.engine
    task_id, got = await _running(services, "diagnostics.sleep_retry_safe", f"{NODE}:101")

    async with repo.owning_transaction(task_id, got.token) as (conn, row):
        expiry = asyncio.create_task(repo.expire_attempts([got.token]))
        await asyncio.sleep(0.3)
        assert not expiry.done(), "the expiry did not wait for the owner's row lock"
        await repo._to_pending(conn, row, outcome="worker_shutdown", delay=0)
    assert await expiry == []
    row = await task_row(engine, task_id)
    assert row["status"] == "pending" and row["lease_expires_at"] is None, row

    again = await claim(repo, services.registry, task_id, worker=f"{NODE}:202")
    assert await repo.expire_attempts([got.token]) == []
    assert await expire_dead(repo, NODE, lambda pid: pid == 101) == []
    row = await task_row(engine, task_id)
    assert row["status"] == "running" and row["attempt_token"] == again.token
    assert (row["lease_expires_at"] - await db_now(engine)).total_seconds() > 20, row
    trail = await attempt_rows(engine, task_id)
    assert [a["outcome"] for a in trail] == ["worker_shutdown", None], trail


async def test_an_expiry_that_commits_first_fences_the_owner_out(services: Any) -> None:
    repo, engine = services.repo, services.engine
    task_id, got = await _running(services, "diagnostics.sleep", f"{NODE}:101")
    assert await repo.expire_attempts([got.token]) == [task_id]
    assert not await repo.report(task_id, got.token, 50.0, "still here")
    assert (await task_row(engine, task_id))["progress"] != 50.0


async def test_a_lease_that_already_ran_out_is_left_as_it_was(services: Any) -> None:
    """Expiry only ever shortens a live lease: one that already lapsed keeps its end (the attempt
    ended then, and the reconciler dates its end so)."""
    engine = services.engine
    task_id, got = await _running(services, "diagnostics.sleep", f"{NODE}:101")
    lease = (await task_row(engine, task_id))["lease_expires_at"]
    later = at(engine, lease + timedelta(seconds=5))
    assert await later.expire_attempts([got.token]) == []
    assert (await task_row(engine, task_id))["lease_expires_at"] == lease
