"""The reconciler and the publisher's fail-closed pass: every stranded row converges (I3, I6)."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import timedelta
from typing import Any

from hooks_for_tests import registry_with_test_specs
from repo_helpers import (
    at,
    attempt_rows,
    claim,
    db_now,
    insert_raw,
    run_row,
    running_task,
    sleep_past,
    start_run_row,
    submit,
    task_row,
)

from tasks_core.duties import reconciler
from tasks_core.duties.publisher import publish_pending
from tasks_core.registry import Registry
from tasks_core.store.facade import TaskStore
from tasks_core.store.outcomes import NewTask


def _with_repo(services: Any, repo: TaskStore, registry: Registry | None = None) -> Any:
    """The same services (engine, transport, Redis) seen through another clock and/or registry."""
    return dataclasses.replace(services, repo=repo, registry=registry or services.registry)


async def test_expired_lease_fails_the_task_through_its_failure_hook(services: Any) -> None:
    """I3, I6: an owner that stopped renewing is converged to `failed` (`lease_expired`); the
    failure hook converges its domain row in the same transaction; its attempt ends at the lease.
    A task whose lease is still live is not touched."""
    reg, engine = services.registry, services.engine
    dead_id, dead = await running_task(services.repo, reg, lease=30)
    live_id, _live = await running_task(services.repo, reg, lease=600)
    lease = (await task_row(engine, dead_id))["lease_expires_at"]

    later = _with_repo(services, at(engine, lease + timedelta(seconds=1)))
    report = await reconciler.reconcile(later)

    assert (report.failed, report.retried, report.hook_errors, report.errors) == (1, 0, 0, [])
    row = await task_row(engine, dead_id)
    assert row["status"] == "failed" and row["error"]["code"] == "lease_expired"
    assert row["attempt_token"] is None and row["lease_expires_at"] is None
    assert row["finished_at"] == lease + timedelta(seconds=1)
    run = await run_row(engine, dead_id)
    assert run is not None and (run["status"], run["hook"]) == ("failed", "failure:failed")
    [attempt] = await attempt_rows(engine, dead_id)
    assert (attempt["token"], attempt["outcome"], attempt["ended_at"]) == (dead.token, "lease_expired", lease)

    assert (await task_row(engine, live_id))["status"] == "running"
    assert (await run_row(engine, live_id))["status"] == "running"  # type: ignore[index]
    # A second run finds nothing more to do.
    again = await reconciler.reconcile(later)
    assert (again.failed, again.retried, again.legacy, again.unrunnable) == (0, 0, 0, 0)


async def test_reconciler_recovers_a_real_short_lease(services: Any) -> None:
    """I3 with the real clock: a 1 s lease left to lapse is failed by a reconcile run right after."""
    task_id, _ = await running_task(services.repo, services.registry, lease=1.0)
    assert (await reconciler.reconcile(services)).failed == 0
    lease = (await task_row(services.engine, task_id))["lease_expires_at"]
    await sleep_past(services.engine, lease)
    assert (await reconciler.reconcile(services)).failed == 1
    assert (await task_row(services.engine, task_id))["status"] == "failed"
    assert (await run_row(services.engine, task_id))["status"] == "failed"  # type: ignore[index]


async def test_expired_lease_with_cancel_intent_ends_cancelled(services: Any) -> None:
    reg, engine = services.registry, services.engine
    task_id, _ = await running_task(services.repo, reg)
    assert await services.repo.request_cancel(task_id, reg) == "requested"
    lease = (await task_row(engine, task_id))["lease_expires_at"]
    await reconciler.reconcile(_with_repo(services, at(engine, lease + timedelta(seconds=1))))
    assert (await task_row(engine, task_id))["status"] == "cancelled"
    assert (await run_row(engine, task_id))["status"] == "cancelled"  # type: ignore[index]


async def test_one_failing_hook_does_not_stop_the_others(services: Any) -> None:
    """One bad task never blocks the rest: of three expired tasks whose failure hook raises for the
    middle one, all three end `failed`; the two good ones through their hook, the bad one without
    it (its half-done hook writes rolled back) and with the hook's failure in its error message."""
    reg = registry_with_test_specs()
    engine = services.engine
    ids = []
    for payload in ({"n": 1}, {"n": 2, "explode": True}, {"n": 3}):
        task_id, _ = await running_task(services.repo, reg, "test.flaky_hook", payload)
        ids.append(task_id)
    good1, bad, good2 = ids
    lease = max([(await task_row(engine, i))["lease_expires_at"] for i in ids])

    report = await reconciler.reconcile(_with_repo(services, at(engine, lease + timedelta(seconds=1)), reg))

    assert (report.failed, report.hook_errors, report.errors) == (3, 1, [])
    for task_id in (good1, good2):
        row = await task_row(engine, task_id)
        assert (row["status"], row["error"]["code"]) == ("failed", "lease_expired")
        assert (await run_row(engine, task_id))["status"] == "failed"  # type: ignore[index]
    row = await task_row(engine, bad)
    assert (row["status"], row["error"]["code"]) == ("failed", "lease_expired")
    assert "failure hook raised" in row["error"]["message"] and "HookExploded" in row["error"]["message"]
    run = await run_row(engine, bad)
    assert run is not None and (run["status"], run["hook"]) == ("running", None)


class PoisonedRegistry(Registry):
    """A registry that blows up while deciding about one task type (a bug outside any hook)."""

    def runnable(self, task_type: str, version: int) -> Any:
        if task_type == "test.retry_safe":
            raise RuntimeError("registry lookup exploded")
        return super().runnable(task_type, version)


async def test_a_task_whose_convergence_raises_is_skipped_and_the_rest_converge(services: Any) -> None:
    """One bad task never blocks the rest, even when the failure is outside the hook: the
    reconciler reports it, leaves it as it was, and converges the others in the same run."""
    base = registry_with_test_specs()
    engine = services.engine
    poisoned = PoisonedRegistry(base.specs())
    bad_id, _ = await running_task(services.repo, base, "test.retry_safe")
    good_ids = [(await running_task(services.repo, base))[0] for _ in range(2)]
    lease = max([(await task_row(engine, i))["lease_expires_at"] for i in [bad_id, *good_ids]])
    before = await task_row(engine, bad_id)

    report = await reconciler.reconcile(
        _with_repo(services, at(engine, lease + timedelta(seconds=1)), poisoned)
    )

    assert report.failed == 2
    assert len(report.errors) == 1 and str(bad_id) in report.errors[0] and "exploded" in report.errors[0]
    assert await task_row(engine, bad_id) == before
    for task_id in good_ids:
        assert (await task_row(engine, task_id))["status"] == "failed"


async def test_retry_safe_task_goes_back_to_pending_with_backoff_until_attempts_run_out(
    services: Any,
) -> None:
    """Design 9/13: a retry-safe handler with attempts left returns to pending, claimable only after
    its backoff; on its last attempt a lapse fails it through the hook like any other."""
    reg = registry_with_test_specs()
    engine = services.engine
    task_id = await submit(services.repo, "test.retry_safe", dedupe_key="retry-me")
    first = await claim(services.repo, reg, task_id)
    await start_run_row(services.repo, task_id, first.token)
    lease = (await task_row(engine, task_id))["lease_expires_at"]

    t1 = lease + timedelta(seconds=1)
    report = await reconciler.reconcile(_with_repo(services, at(engine, t1), reg))

    assert (report.retried, report.failed) == (1, 0)
    row = await task_row(engine, task_id)
    backoff = timedelta(seconds=services.settings.retry_backoff_seconds)
    assert row["status"] == "pending" and row["attempt_token"] is None and row["lease_expires_at"] is None
    # The first backoff, with equal jitter: between half of it and all of it.
    assert t1 + backoff / 2 <= row["not_before"] <= t1 + backoff
    assert row["finished_at"] is None and row["error"] is None
    assert (await attempt_rows(engine, task_id))[0]["outcome"] == "lease_expired"
    assert (await run_row(engine, task_id))["status"] == "running"  # not converged: it will run again
    # Still the active holder of its dedupe key while it waits.
    async with engine.begin() as conn:
        dup = await services.repo.insert(conn, NewTask("test.retry_safe", 1, {}, 60.0, "retry-me"))
    assert dup.duplicate_of == task_id

    assert await at(engine, t1 + backoff / 4).claim(task_id, reg, capacity=4, lease_seconds=30) == "backoff"
    t2 = t1 + backoff + timedelta(seconds=1)
    second = await claim(at(engine, t2), reg, task_id, worker="worker-b")
    assert second.attempt == 2

    t3 = t2 + timedelta(seconds=31)
    report = await reconciler.reconcile(_with_repo(services, at(engine, t3), reg))
    assert (report.retried, report.failed) == (0, 1)
    row = await task_row(engine, task_id)
    assert (row["status"], row["error"]["code"], row["attempt_count"]) == ("failed", "lease_expired", 2)
    assert (await run_row(engine, task_id))["status"] == "failed"  # type: ignore[index]
    assert [a["outcome"] for a in await attempt_rows(engine, task_id)] == ["lease_expired", "lease_expired"]


async def test_legacy_rows_converge_through_the_current_failure_hook(services: Any) -> None:
    """Design 7/9, I6: version-0 rows left by the pre-durable release, pending or running with an
    expired lease, end `failed` (`legacy_interrupted`) through the current type's failure hook."""
    engine = services.engine
    now = await db_now(engine)
    pending = await insert_raw(engine, version=0, run_row=True)
    running = await insert_raw(
        engine, version=0, status="running", lease_expires_at=now - timedelta(minutes=1), run_row=True
    )

    report = await reconciler.reconcile(services)

    assert report.legacy == 2 and report.errors == []
    for task_id in (pending, running):
        row = await task_row(engine, task_id)
        assert (row["status"], row["error"]["code"]) == ("failed", "legacy_interrupted")
        assert row["finished_at"] is not None and row["attempt_token"] is None
        run = await run_row(engine, task_id)
        assert run is not None and (run["status"], run["hook"]) == ("failed", "failure:failed")


async def test_unknown_versions_fail_closed_without_any_hook(services: Any, redis_client: Any) -> None:
    """Design 8/9: a row of a version this deployment cannot run (99) fails closed with
    `handler_unavailable` and no hook: by the reconciler once its lease is expired (running), by the
    publisher's fail-closed pass (pending). A live lease of another deployment is left alone, and
    runnable pending work is left to its message, not failed."""
    engine = services.engine
    now = await db_now(engine)
    running = await insert_raw(
        engine, version=99, status="running", lease_expires_at=now - timedelta(seconds=1), run_row=True
    )
    live = await insert_raw(
        engine, version=99, status="running", lease_expires_at=now + timedelta(minutes=5), run_row=True
    )
    pending = await insert_raw(engine, version=99, run_row=True)
    unknown_type = await insert_raw(engine, task_type="gone.type", run_row=True)
    runnable = await submit(services.repo)

    report = await reconciler.reconcile(services)
    assert report.unrunnable == 1 and report.legacy == 0 and report.errors == []
    row = await task_row(engine, running)
    assert (row["status"], row["error"]["code"]) == ("failed", "handler_unavailable")
    assert (await task_row(engine, live))["status"] == "running"
    assert (await task_row(engine, pending))["status"] == "pending"  # the reconciler leaves it
    # The run freed a slot and relayed: the runnable task (inserted with no message in flight) is
    # sent; nothing of an unrunnable version is.
    assert redis_client.llen("durable") == 1
    assert (await task_row(engine, runnable))["last_published_at"] is not None

    published = await publish_pending(services)
    assert published.failed_closed == 2
    for task_id in (pending, unknown_type):
        row = await task_row(engine, task_id)
        assert (row["status"], row["error"]["code"]) == ("failed", "handler_unavailable")
        assert row["finished_at"] is not None
    for task_id in (running, pending, unknown_type, live):
        run = await run_row(engine, task_id)
        assert run is not None and (run["status"], run["hook"]) == ("running", None)  # no hook ran
    row = await task_row(engine, runnable)
    assert row["status"] == "pending" and row["last_published_at"] is not None
    assert published.published == 0  # stamped moments ago: not due again before the interval
    assert redis_client.llen("durable") == 1  # still only the relay's message


async def test_two_reconcilers_at_once_converge_each_task_once(services: Any, database_url: str) -> None:
    """Safe to run twice (SKIP LOCKED): two concurrent runs split the work; nothing converges twice."""
    from tasks_core.db import make_engine

    engine = make_engine(database_url, pool_size=4)
    try:
        reg = services.registry
        ids = [(await running_task(services.repo, reg))[0] for _ in range(8)]
        lease = max([(await task_row(engine, i))["lease_expires_at"] for i in ids])
        clock = at(engine, lease + timedelta(seconds=1))
        r1, r2 = await asyncio.gather(
            clock.reconcile(reg, batch=100, retry_delay=lambda n: 1.0),
            clock.reconcile(reg, batch=100, retry_delay=lambda n: 1.0),
        )
        assert r1.failed + r2.failed == 8
        for task_id in ids:
            assert (await task_row(engine, task_id))["status"] == "failed"
            assert [a["outcome"] for a in await attempt_rows(engine, task_id)] == ["lease_expired"]
    finally:
        await engine.dispose()


async def test_reconcile_batch_is_bounded(services: Any) -> None:
    reg, engine = services.registry, services.engine
    ids = [(await running_task(services.repo, reg))[0] for _ in range(5)]
    lease = max([(await task_row(engine, i))["lease_expires_at"] for i in ids])
    clock = at(engine, lease + timedelta(seconds=1))
    assert (await clock.reconcile(reg, batch=3, retry_delay=lambda n: 1.0)).failed == 3
    assert (await clock.reconcile(reg, batch=3, retry_delay=lambda n: 1.0)).failed == 2


async def test_pending_task_left_with_cancel_intent_is_cancelled_by_the_reconciler(services: Any) -> None:
    """I3, design 11: a retry-safe task gets cancel intent, then its worker shuts down and hands it
    back to pending. Claims refuse it and the publisher skips it, so the reconciler must finish the
    cancel (with the failure hook) instead of leaving it pending forever."""
    reg = registry_with_test_specs()
    repo, engine = services.repo, services.engine
    task_id = await submit(repo, "test.retry_safe", dedupe_key="cancel-then-shutdown")
    got = await claim(repo, reg, task_id)
    await start_run_row(repo, task_id, got.token)
    assert await repo.request_cancel(task_id, reg) == "requested"
    assert await repo.release(task_id, got.token, outcome="worker_shutdown", delay=0) is True
    assert (await task_row(engine, task_id))["status"] == "pending"
    assert await repo.claim(task_id, reg, capacity=4, lease_seconds=30) == "cancel_requested"
    assert await repo.claim_for_publish(reg, limit=10, republish_after=None) == []

    report = await reconciler.reconcile(_with_repo(services, repo, reg))

    assert report.cancelled == 1 and report.errors == []
    row = await task_row(engine, task_id)
    assert (row["status"], row["error"]["code"]) == ("cancelled", "cancelled")
    assert row["finished_at"] is not None
    run = await run_row(engine, task_id)
    assert run is not None and (run["status"], run["hook"]) == ("cancelled", "failure:cancelled")
    assert await submit(repo, "test.retry_safe", dedupe_key="cancel-then-shutdown") != task_id


async def test_legacy_rows_with_cancel_intent_end_cancelled(services: Any) -> None:
    """Design 7: the upgrade keeps cancel intents of old tasks; converging them honours the intent."""
    engine = services.engine
    now = await db_now(engine)
    pending = await insert_raw(engine, version=0, cancel_requested_at=now, run_row=True)
    running = await insert_raw(
        engine,
        version=0,
        status="running",
        lease_expires_at=now - timedelta(minutes=1),
        cancel_requested_at=now,
        run_row=True,
    )
    report = await reconciler.reconcile(services)
    assert report.legacy == 2
    for task_id in (pending, running):
        assert (await task_row(engine, task_id))["status"] == "cancelled"
        assert (await run_row(engine, task_id))["status"] == "cancelled"  # type: ignore[index]


async def test_a_worker_stopped_inside_its_transaction_cannot_keep_its_task_from_the_reconciler(
    services: Any, database_url: str
) -> None:
    """A worker process stopped mid-transaction holds its task's row lock; the reconciler (which
    skips locked rows) ends worker sessions whose transaction outlived a lease, then converges."""
    import asyncpg

    repo, reg = services.repo, services.registry
    task_id = await submit(repo)
    got = await repo.claim(task_id, reg, capacity=4, lease_seconds=0.5)
    dsn = database_url.replace("postgresql+asyncpg://", "postgresql://")
    stalled = await asyncpg.connect(dsn, server_settings={"application_name": "dtask-worker:999999"})
    try:
        await stalled.execute("BEGIN")
        await stalled.execute("SELECT 1 FROM tasks WHERE id = $1 FOR UPDATE", task_id)  # the owner's lock
        await asyncio.sleep(1.0)  # its lease (0.5 s) lapses while it holds the lock
        report = await repo.reconcile(reg, batch=10, retry_delay=lambda n: 0)
        assert report.failed == 0  # the locked row is skipped
        report = await repo.reconcile(reg, batch=10, retry_delay=lambda n: 0, stalled_after=0.5)
        assert report.sessions_ended == 1 and report.failed == 1, report
        row = await task_row(services.engine, task_id)
        assert (row["status"], row["error"]["code"]) == ("failed", "lease_expired")
        assert got is not None
    finally:
        if not stalled.is_closed():
            await stalled.close(timeout=2)
