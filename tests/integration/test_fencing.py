"""Fenced writes and the owning transaction: only the live owner of an unexpired lease commits."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

import pytest
from hooks_for_tests import registry_with_test_specs
from repo_helpers import (
    at,
    attempt_rows,
    claim,
    db_now,
    effect_rows,
    run_row,
    running_task,
    scalar,
    sleep_past,
    start_run_row,
    submit,
    task_row,
    wait_until_blocked_on_a_lock,
)

from domains.diagnostics.model import diagnostics_effects, diagnostics_runs
from tasks_core.model import Status
from tasks_core.store.facade import TaskStore
from tasks_core.store.outcomes import Claim, OwnershipLost


async def _late_writes_all_rejected(repo: TaskStore, task_id: uuid.UUID, token: uuid.UUID) -> None:
    """Try every kind of owner write with `token` through `repo`; each must be refused."""
    assert await repo.report(task_id, token, 55.0, "late progress") is False
    beat = await repo.heartbeat(task_id, token, 30.0)
    assert beat.owned is False

    entered = False
    with pytest.raises(OwnershipLost):
        async with repo.owning_transaction(task_id, token) as (conn, _row):
            entered = True
            await conn.execute(
                diagnostics_effects.insert().values(task_id=task_id, attempt_token=token, step=99)
            )
    assert entered is False, "the domain callback must not even run for a non-owner"

    with pytest.raises(OwnershipLost):
        await repo.finish(
            task_id, token, registry_with_test_specs(), status=Status.SUCCESS, result={"late": 1}
        )
    with pytest.raises(OwnershipLost):
        await repo.finish(
            task_id,
            token,
            registry_with_test_specs(),
            status=Status.FAILED,
            error={"code": "handler_error", "message": "late"},
        )
    assert await repo.release(task_id, token, outcome="worker_shutdown", delay=0) is False


async def test_owner_writes_commit_while_the_lease_is_live(services: Any) -> None:
    """Control case for the rejections below: the live owner's writes all land."""
    repo, reg, engine = services.repo, services.registry, services.engine
    task_id, got = await running_task(repo, reg)
    assert await repo.report(task_id, got.token, 40.0, "step 2") is True
    assert (await repo.heartbeat(task_id, got.token, 30.0)).owned is True
    async with repo.owning_transaction(task_id, got.token) as (conn, _row):
        await conn.execute(
            diagnostics_effects.insert().values(task_id=task_id, attempt_token=got.token, step=1)
        )
    assert (
        await repo.finish(task_id, got.token, reg, status=Status.SUCCESS, result={"n": 1}) == Status.SUCCESS
    )

    row = await task_row(engine, task_id)
    assert (row["status"], row["result"], row["progress"], row["message"]) == (
        "success",
        {"n": 1},
        100,
        "step 2",
    )
    assert row["attempt_token"] is None and row["lease_expires_at"] is None and row["finished_at"] is not None
    assert [e["step"] for e in await effect_rows(engine, task_id)] == [1]
    assert (await run_row(engine, task_id))["status"] == "done"  # type: ignore[index]
    [attempt] = await attempt_rows(engine, task_id)
    assert attempt["outcome"] == "success" and attempt["ended_at"] is not None


async def test_owner_with_an_expired_lease_commits_nothing(services: Any) -> None:
    """I2, I7: once PostgreSQL's clock passes the lease, the (still recorded) owner's progress,
    heartbeat, owning-transaction callback, finish and hand-back are all refused, and the task,
    its attempt and its domain rows read back exactly as before."""
    engine, reg = services.engine, services.registry
    task_id, got = await running_task(services.repo, reg)
    assert await services.repo.report(task_id, got.token, 10.0, "first") is True
    before = await task_row(engine, task_id)

    expired = at(engine, before["lease_expires_at"] + timedelta(microseconds=1))
    await _late_writes_all_rejected(expired, task_id, got.token)
    # Exactly at the lease instant the lease is already over (`lease_expires_at > now`).
    await _late_writes_all_rejected(at(engine, before["lease_expires_at"]), task_id, got.token)

    assert await task_row(engine, task_id) == before
    assert await effect_rows(engine, task_id) == []
    run = await run_row(engine, task_id)
    assert run is not None and (run["status"], run["hook"]) == ("running", None)
    [attempt] = await attempt_rows(engine, task_id)
    assert attempt["ended_at"] is None and attempt["outcome"] is None


async def test_foreign_token_commits_nothing_even_while_the_lease_is_live(services: Any) -> None:
    """I2: a token that is not the row's current one (a stale message, a forged id) is refused,
    and the real owner keeps writing afterwards."""
    repo, reg, engine = services.repo, services.registry, services.engine
    task_id, got = await running_task(repo, reg)
    before = await task_row(engine, task_id)

    await _late_writes_all_rejected(repo, task_id, uuid.uuid4())
    # A real token of another task does not open this one either.
    _other_id, other = await running_task(repo, reg)
    await _late_writes_all_rejected(repo, task_id, other.token)

    assert await task_row(engine, task_id) == before
    assert await effect_rows(engine, task_id) == []
    assert await repo.report(task_id, got.token, 20.0, None) is True


async def test_replaced_owner_cannot_write_over_its_successor(services: Any) -> None:
    """I1, I2: attempt 1 lapses, the reconciler hands the retry-safe task back, attempt 2 claims it.
    Attempt 1's writes are refused; attempt 2's land; the audit shows attempt 1 ended at its lease."""
    reg = registry_with_test_specs()
    engine = services.engine
    task_id = await submit(services.repo, "test.retry_safe")
    first = await claim(services.repo, reg, task_id)
    await start_run_row(services.repo, task_id, first.token)
    lease1 = (await task_row(engine, task_id))["lease_expires_at"]

    clock = at(engine, lease1 + timedelta(seconds=1))
    report = await clock.reconcile(reg, batch=10, retry_delay=lambda n: 5.0)
    assert report.retried == 1
    clock.now = lease1 + timedelta(seconds=10)  # past the 5 s backoff
    second = await claim(clock, reg, task_id, worker="worker-b")
    assert second.attempt == 2 and second.token != first.token

    before = await task_row(engine, task_id)
    await _late_writes_all_rejected(clock, task_id, first.token)
    assert await task_row(engine, task_id) == before

    async with clock.owning_transaction(task_id, second.token) as (conn, _row):
        await conn.execute(
            diagnostics_effects.insert().values(task_id=task_id, attempt_token=second.token, step=1)
        )
    assert (
        await clock.finish(task_id, second.token, reg, status=Status.SUCCESS, result={"a": 2})
        == Status.SUCCESS
    )

    assert [e["attempt_token"] for e in await effect_rows(engine, task_id)] == [second.token]
    a1, a2 = await attempt_rows(engine, task_id)
    assert (a1["token"], a1["outcome"], a1["ended_at"]) == (first.token, "lease_expired", lease1)
    assert (a2["token"], a2["outcome"]) == (second.token, "success")
    assert a1["ended_at"] <= a2["claimed_at"]  # I1: the two leases never overlapped
    assert (await task_row(engine, task_id))["result"] == {"a": 2}


async def test_lease_lapsing_inside_the_owning_transaction_rolls_it_back(services: Any) -> None:
    """Protocol step 5: the lease is re-checked before commit; if the clock passed it while the
    callback ran, every write of the block is rolled back and OwnershipLost is raised."""
    engine, reg = services.engine, services.registry
    repo = at(engine, await db_now(engine))
    task_id = await submit(repo)
    got = await claim(repo, reg, task_id, lease=5.0)
    await start_run_row(repo, task_id, got.token)

    with pytest.raises(OwnershipLost, match="lapsed"):
        async with repo.owning_transaction(task_id, got.token) as (conn, _row):
            await conn.execute(
                diagnostics_effects.insert().values(task_id=task_id, attempt_token=got.token, step=1)
            )
            await conn.execute(
                diagnostics_runs.update().where(diagnostics_runs.c.task_id == task_id).values(steps_done=1)
            )
            assert repo.now is not None
            repo.now += timedelta(seconds=5)  # the callback "took" the rest of the lease

    assert await effect_rows(engine, task_id) == []
    assert (await run_row(engine, task_id))["steps_done"] == 0  # type: ignore[index]

    # The same lapse during the terminal transaction: no status, no hook, no attempt record.
    repo.now -= timedelta(seconds=5)

    class SlowHooks:
        def hook_for(self, task_type: str, version: int, kind: Any) -> Any:
            async def hook(conn: Any, task: Any, status: str) -> None:
                await conn.execute(
                    diagnostics_runs.update()
                    .where(diagnostics_runs.c.task_id == task_id)
                    .values(status="done")
                )
                repo.now += timedelta(seconds=5)

            return hook

    with pytest.raises(OwnershipLost):
        await repo.finish(task_id, got.token, SlowHooks(), status=Status.SUCCESS, result={"x": 1})
    row = await task_row(engine, task_id)
    assert (row["status"], row["result"], row["attempt_token"]) == ("running", None, got.token)
    assert (await run_row(engine, task_id))["status"] == "running"  # type: ignore[index]
    assert (await attempt_rows(engine, task_id))[0]["ended_at"] is None


async def _hold_run_row_lock(
    engine: Any, task_id: uuid.UUID, locked: asyncio.Event, release: asyncio.Event
) -> None:
    """Another session locks the task's domain row and keeps it until told to let go."""
    async with engine.connect() as conn, conn.begin():
        await conn.execute(
            diagnostics_runs.select().where(diagnostics_runs.c.task_id == task_id).with_for_update()
        )
        locked.set()
        await release.wait()


async def _owner_writes_behind_lock(repo: TaskStore, task_id: uuid.UUID, token: uuid.UUID) -> None:
    async with repo.owning_transaction(task_id, token) as (conn, _row):
        await conn.execute(diagnostics_effects.insert().values(task_id=task_id, attempt_token=token, step=1))
        # Waits for the other session's row lock.
        await conn.execute(
            diagnostics_runs.update().where(diagnostics_runs.c.task_id == task_id).values(steps_done=1)
        )


async def test_lock_wait_that_outlives_the_lease_rolls_the_owning_transaction_back(services: Any) -> None:
    """Protocol step 5, I2 with the real clock: the owner's callback waits on a domain-row lock held
    by another session past the owner's (1 s) lease. When the lock is granted the callback
    finishes, but the pre-commit lease check fails: all its writes are rolled back."""
    repo, reg, engine = services.repo, services.registry, services.engine
    task_id, got = await running_task(repo, reg, lease=1.0)
    lease = (await task_row(engine, task_id))["lease_expires_at"]
    locked, release = asyncio.Event(), asyncio.Event()
    holder = asyncio.create_task(_hold_run_row_lock(engine, task_id, locked, release))
    await locked.wait()

    owner = asyncio.create_task(_owner_writes_behind_lock(repo, task_id, got.token))
    await wait_until_blocked_on_a_lock(engine)
    await sleep_past(engine, lease + timedelta(milliseconds=50))
    release.set()
    await holder
    with pytest.raises(OwnershipLost, match="lapsed"):
        await owner

    assert await effect_rows(engine, task_id) == []
    run = await run_row(engine, task_id)
    assert run is not None and run["steps_done"] == 0
    row = await task_row(engine, task_id)
    assert row["status"] == "running" and row["lease_expires_at"] == lease  # nothing renewed it


async def test_lock_wait_within_the_lease_commits(services: Any) -> None:
    """Control case: the same lock wait, released well inside a long lease, commits its writes."""
    repo, reg, engine = services.repo, services.registry, services.engine
    task_id, got = await running_task(repo, reg, lease=30.0)
    locked, release = asyncio.Event(), asyncio.Event()
    holder = asyncio.create_task(_hold_run_row_lock(engine, task_id, locked, release))
    await locked.wait()
    owner = asyncio.create_task(_owner_writes_behind_lock(repo, task_id, got.token))
    await wait_until_blocked_on_a_lock(engine)
    release.set()
    await holder
    await owner
    assert [e["step"] for e in await effect_rows(engine, task_id)] == [1]
    assert (await run_row(engine, task_id))["steps_done"] == 1  # type: ignore[index]


async def test_real_short_lease_expires_on_its_own(services: Any) -> None:
    """I2, I7 with the real clock: a 1 s lease nobody renews stops admitting the owner's writes."""
    repo, reg, engine = services.repo, services.registry, services.engine
    task_id, got = await running_task(repo, reg, lease=1.0)
    assert await repo.report(task_id, got.token, 5.0, None) is True
    lease = (await task_row(engine, task_id))["lease_expires_at"]
    await sleep_past(engine, lease)
    before = await task_row(engine, task_id)
    await _late_writes_all_rejected(repo, task_id, got.token)
    assert await task_row(engine, task_id) == before
    assert before["progress"] == 5.0


async def test_cancel_intent_beats_a_later_success(services: Any) -> None:
    """Protocol 6/11: cancel requested on a running task, then the owner reports success: the task
    ends `cancelled`, its failure hook converges the domain row, and the dedupe key is free."""
    repo, reg, engine = services.repo, services.registry, services.engine
    task_id, got = await running_task(repo, reg, dedupe_key="k-cancel")

    assert await repo.request_cancel(task_id, reg) == "requested"
    first_intent = (await task_row(engine, task_id))["cancel_requested_at"]
    assert first_intent is not None
    assert await repo.request_cancel(task_id, reg) == "requested"  # idempotent: first intent kept
    assert (await task_row(engine, task_id))["cancel_requested_at"] == first_intent
    assert (await repo.heartbeat(task_id, got.token, 30.0)).cancel_requested is True

    final = await repo.finish(task_id, got.token, reg, status=Status.SUCCESS, result={"done": True})
    assert final == Status.CANCELLED
    row = await task_row(engine, task_id)
    assert row["status"] == "cancelled" and row["result"] is None
    assert row["error"]["code"] == "cancelled" and row["finished_at"] is not None
    run = await run_row(engine, task_id)
    assert run is not None and (run["status"], run["hook"]) == ("cancelled", "failure:cancelled")
    assert (await attempt_rows(engine, task_id))[0]["outcome"] == "cancelled"
    assert await submit(repo, dedupe_key="k-cancel") != task_id  # I4: the terminal task let go


async def test_cancel_and_success_racing_agree_on_one_outcome(services: Any, database_url: str) -> None:
    """Cancel vs. success truly concurrently, many times: the row lock orders them. Either cancel
    came first (`requested`) and the task ends `cancelled` with the failure hook, or success came
    first and cancel answers `terminal`. Never a cancel acknowledged as requested and then lost."""
    from tasks_core.db import make_engine

    engine = make_engine(database_url, pool_size=10)
    repo, reg = TaskStore(engine), services.registry
    try:
        for i in range(16):
            task_id, got = await running_task(repo, reg)
            gate = asyncio.Event()

            async def cancel(tid: uuid.UUID = task_id, g: asyncio.Event = gate, n: int = i) -> str | None:
                await g.wait()
                if n % 4:  # jitter, so both orders occur
                    await asyncio.sleep((n % 4) * 0.001)
                return await repo.request_cancel(tid, reg)

            async def succeed(
                tid: uuid.UUID = task_id, c: Claim = got, g: asyncio.Event = gate, n: int = i
            ) -> Status:
                await g.wait()
                return await repo.finish(tid, c.token, reg, status=Status.SUCCESS, result={"i": n})

            pending = [asyncio.ensure_future(cancel()), asyncio.ensure_future(succeed())]
            gate.set()
            answer, final = await asyncio.gather(*pending)
            row, run = await task_row(engine, task_id), await run_row(engine, task_id)
            assert run is not None
            if answer == "requested":
                assert final == Status.CANCELLED
                assert (row["status"], row["result"], run["status"]) == ("cancelled", None, "cancelled")
            else:
                assert answer == "terminal"
                assert final == Status.SUCCESS
                assert (row["status"], row["result"], run["status"]) == ("success", {"i": i}, "done")
        assert await scalar(engine, "SELECT count(*) FROM tasks WHERE status = 'running'") == 0
    finally:
        await engine.dispose()


async def test_heartbeat_renews_the_lease_on_the_database_clock(services: Any) -> None:
    """I7: renewal sets `lease = now + lease_seconds` by PostgreSQL's clock (pinned here); the owner
    stays live past its first lease only because it renewed."""
    engine, reg = services.engine, services.registry
    t0 = await db_now(engine)
    clock = at(engine, t0)
    task_id = await submit(clock)
    got = await claim(clock, reg, task_id, lease=10)
    clock.now = t0 + timedelta(seconds=8)
    assert (await clock.heartbeat(task_id, got.token, 10)).owned is True
    row = await task_row(engine, task_id)
    assert (row["lease_expires_at"], row["heartbeat_at"]) == (t0 + timedelta(seconds=18), clock.now)
    clock.now = t0 + timedelta(seconds=15)  # past the first lease, inside the renewed one
    assert await clock.report(task_id, got.token, 50.0, "still here") is True
    clock.now = t0 + timedelta(seconds=18)
    assert (await clock.heartbeat(task_id, got.token, 10)).owned is False  # too late to renew
    assert (await task_row(engine, task_id))["lease_expires_at"] == t0 + timedelta(seconds=18)


async def test_claim_and_cancel_racing_on_a_pending_task_agree(services: Any, database_url: str) -> None:
    """A pending task claimed and cancelled at the same instant, many times: either the cancel wins
    (`cancelled`, the claim is refused, no attempt) or the claim wins (cancel becomes `requested`
    on a running task). Never a cancelled task with a live owner."""
    from tasks_core.db import make_engine

    engine = make_engine(database_url, pool_size=10)
    repo, reg = TaskStore(engine), services.registry
    try:
        for i in range(16):
            task_id = await submit(repo)
            gate = asyncio.Event()

            async def cancel(tid: uuid.UUID = task_id, g: asyncio.Event = gate, n: int = i) -> str | None:
                await g.wait()
                if n % 4:  # jitter, so both orders occur
                    await asyncio.sleep((n % 4) * 0.001)
                return await repo.request_cancel(tid, reg)

            async def take(tid: uuid.UUID = task_id, g: asyncio.Event = gate) -> Claim | str:
                await g.wait()
                return await repo.claim(tid, reg, capacity=100, lease_seconds=30)

            racers = [asyncio.ensure_future(cancel()), asyncio.ensure_future(take())]
            gate.set()
            answer, claimed = await asyncio.gather(*racers)
            row = await task_row(engine, task_id)
            attempts = await attempt_rows(engine, task_id)
            if answer == "cancelled":
                assert claimed == "not_pending:cancelled"
                assert (row["status"], row["attempt_token"], attempts) == ("cancelled", None, [])
            else:
                assert answer == "requested" and isinstance(claimed, Claim)
                assert row["status"] == "running" and row["cancel_requested_at"] is not None
                assert [a["token"] for a in attempts] == [claimed.token]
    finally:
        await engine.dispose()
