"""Relay and publisher selection: a dropped message is re-sent when a slot frees, a queued one is
not duplicated, and a stale publication is re-sent by the publisher only."""

from __future__ import annotations

import itertools
import uuid
from datetime import timedelta
from typing import Any

from tasks_core.duties.relay import relay
from tasks_core.submission import Submitter, TaskIntent
from tests.integration.repo_helpers import attempt_rows


async def test_relay_resends_only_tasks_whose_message_was_dropped(services: Any, redis_client: Any) -> None:
    repo, registry = services.repo, services.registry
    services.settings.publish_ahead = 4  # messages queued ahead of the free slots
    submitted = [
        (await Submitter(services).submit(TaskIntent("diagnostics.sleep", {"steps": i + 1}))).task_id
        for i in range(6)
    ]
    assert redis_client.llen("durable") == 6
    for task_id in submitted[:4]:
        assert not isinstance(await repo.claim(task_id, registry, capacity=4, lease_seconds=30), str)
    # The fifth message arrives while capacity is full: dropped, and the row says so.
    assert await repo.claim(submitted[4], registry, capacity=4, lease_seconds=30) == "capacity_full"
    assert (await repo.get(submitted[4]))["last_published_at"] is None
    assert (await repo.get(submitted[5]))["last_published_at"] is not None  # its message is still queued

    assert await repo.claim_for_publish(registry, limit=10, republish_after=None) == [submitted[4]]
    assert await repo.claim_for_publish(registry, limit=10, republish_after=None) == []  # stamped again

    # The publisher re-sends what was published longer ago than its interval (a lost message).
    repo.now = (await repo.get(submitted[5]))["last_published_at"] + timedelta(seconds=60)
    assert await repo.claim_for_publish(registry, limit=10, republish_after=30) == submitted[4:]
    repo.now = None


async def test_relay_publishes_about_as_many_as_free_slots(services: Any, redis_client: Any) -> None:
    repo, registry = services.repo, services.registry
    services.settings.publish_ahead = 0  # exactly the free slots, no messages queued ahead
    ids = [(await Submitter(services).submit(TaskIntent("diagnostics.noop", {}))).task_id for _ in range(7)]
    for task_id in ids:
        await repo.claim(task_id, registry, capacity=3, lease_seconds=30)  # 3 run, 4 dropped
    redis_client.delete("durable")
    assert len((await relay(services)).ids) == 1  # capacity 4 in settings, 3 running: one free slot
    assert redis_client.llen("durable") == 1
    waiting = [(await repo.get(i))["last_published_at"] is None for i in ids[3:]]
    assert waiting == [False, True, True, True]  # the oldest dropped task went first


async def test_a_big_batch_puts_only_what_capacity_can_take_on_the_broker_and_strands_nothing(
    services: Any, redis_client: Any
) -> None:
    """A thousand intents when the cluster runs four: capacity + ahead messages, then one per
    freed slot, until every task has run — driven here exactly as workers do (claim each message,
    finish, relay)."""
    from tasks_core.model import Status
    from tasks_core.store.outcomes import Claim

    repo, registry, s = services.repo, services.registry, services.settings
    s.publish_ahead = 2
    outcomes = await Submitter(services).submit_many(
        [TaskIntent("diagnostics.noop", {"n": i}) for i in range(60)]
    )
    assert sum(o.published for o in outcomes) == s.capacity + 2  # type: ignore[union-attr]
    assert redis_client.llen("durable") == s.capacity + 2
    messages = 0
    while (raw := redis_client.rpop("durable")) is not None:
        messages += 1
        import json

        task_id = uuid.UUID(json.loads(raw)["headers"]["argsrepr"].strip("[]'(),"))
        claim = await repo.claim(task_id, registry, capacity=s.capacity, lease_seconds=30)
        if isinstance(claim, Claim):
            await repo.finish(task_id, claim.token, registry, status=Status.SUCCESS, result={})
        await relay(services)
    summary = await repo.summary()
    assert summary["by_status"]["success"] == 60 and summary["total"] == 60  # nothing stranded
    assert messages == 60  # one message per task: none wasted on a full cluster


async def test_a_stalled_claimer_never_blocks_other_claims(services: Any) -> None:
    """A claimer paused inside its claim (holding a capacity slot's row lock) must not block every
    other claim: the others take other slots without waiting (SKIP LOCKED)."""
    import time

    from sqlalchemy import text

    repo, registry = services.repo, services.registry
    task_id = (await Submitter(services).submit(TaskIntent("diagnostics.noop", {}))).task_id
    await repo.claim(uuid.uuid4(), registry, capacity=4, lease_seconds=30)  # creates the slot rows
    async with services.engine.connect() as holder:
        await holder.begin()
        await holder.execute(text("SELECT slot FROM task_slots WHERE slot = 0 FOR UPDATE"))
        started = time.monotonic()
        outcome = await repo.claim(task_id, registry, capacity=4, lease_seconds=30, lock_wait_seconds=0.3)
        waited = time.monotonic() - started
        await holder.rollback()
    assert not isinstance(outcome, str), outcome
    assert waited < 0.3  # it never waited for the lock (a protocol bound: lock_wait_seconds)
    async with services.engine.connect() as conn:
        slot = await conn.execute(text("SELECT slot FROM task_slots WHERE task_id = :id"), {"id": task_id})
        assert slot.scalar_one() != 0


async def test_a_stalled_holder_of_a_type_lock_delays_claims_of_that_type_by_a_bounded_wait(
    services: Any,
) -> None:
    """Where a per-type cap serialises claimers, a paused one costs the others a bounded wait:
    the claim is refused (capacity_busy) and the task re-sent later."""
    from sqlalchemy import text

    from tests.integration.hooks_for_tests import registry_with_test_specs
    from tests.integration.repo_helpers import submit as insert_task

    repo, registry = services.repo, registry_with_test_specs()
    task_id = await insert_task(repo, "test.capped")
    async with services.engine.connect() as holder:
        await holder.begin()
        await holder.execute(
            text("SELECT pg_advisory_xact_lock(hashtextextended(:k, 0))"), {"k": "dtask-type:test.capped"}
        )
        outcome = await repo.claim(task_id, registry, capacity=4, lease_seconds=30, lock_wait_seconds=0.3)
        await holder.rollback()
    assert outcome == "capacity_busy"
    row = await repo.get(task_id)
    assert row["status"] == "pending" and row["last_published_at"] is None  # will be re-sent
    assert not isinstance(await repo.claim(task_id, registry, capacity=4, lease_seconds=30), str)


async def test_a_session_idle_inside_a_transaction_is_ended_after_a_lease(clean_db: None) -> None:
    """PostgreSQL ends our sessions that idle in a transaction for a lease (a paused process)."""
    import asyncio

    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    from tasks_core.services import build_services
    from tests.conftest import make_settings

    svc = build_services(make_settings(lease_seconds=0.5), pool_size=1)
    try:
        async with svc.engine.connect() as conn:
            await conn.begin()
            await conn.execute(text("SELECT 1"))
            await asyncio.sleep(1.5)  # "paused" past the lease while inside the transaction
            try:
                await conn.execute(text("SELECT 1"))
                ended = False
            except DBAPIError:
                ended = True
        assert ended
    finally:
        await svc.close()


async def test_the_terminal_write_hands_its_freed_slot_to_the_oldest_waiting_task(services: Any) -> None:
    """The relay's work done by the terminal statement itself: with capacity full and nothing
    queued ahead, ending one task stamps exactly one waiting task — the oldest — and returns it."""
    from tasks_core.model import Status
    from tasks_core.store.outcomes import Claim, RelayOptions

    repo, registry = services.repo, services.registry
    ids = [(await Submitter(services).submit(TaskIntent("diagnostics.noop", {}))).task_id for _ in range(6)]
    claims = [await repo.claim(task_id, registry, capacity=3, lease_seconds=30) for task_id in ids]
    assert [isinstance(c, Claim) for c in claims] == [True] * 3 + [False] * 3  # 3 dropped, unstamped
    first = claims[0]
    assert isinstance(first, Claim)
    hand_on = RelayOptions(registry, capacity=3, ahead=0, window=60.0, limit=100)
    finished = await repo.finish_and_relay(
        ids[0], first.token, registry, status=Status.SUCCESS, relay=hand_on
    )
    assert finished.status == Status.SUCCESS
    assert finished.relay == [(ids[3], "diagnostics.noop")]
    stamped = [(await repo.get(i))["last_published_at"] is not None for i in ids[3:]]
    assert stamped == [True, False, False]


async def test_a_refused_terminal_write_hands_nothing_on(services: Any) -> None:
    from tasks_core.model import Status
    from tasks_core.store.outcomes import Claim, OwnershipLost, RelayOptions

    repo, registry = services.repo, services.registry
    ids = [(await Submitter(services).submit(TaskIntent("diagnostics.noop", {}))).task_id for _ in range(3)]
    claim = await repo.claim(ids[0], registry, capacity=1, lease_seconds=30)
    assert isinstance(claim, Claim)
    assert await repo.claim(ids[1], registry, capacity=1, lease_seconds=30) == "capacity_full"
    hand_on = RelayOptions(registry, capacity=1, ahead=4, window=60.0, limit=100)
    try:
        await repo.finish_and_relay(ids[0], uuid.uuid4(), registry, status=Status.SUCCESS, relay=hand_on)
    except OwnershipLost:
        pass
    else:
        raise AssertionError("a terminal write under a stranger's token was accepted")
    assert (await repo.get(ids[0]))["status"] == "running"
    assert (await repo.get(ids[1]))["last_published_at"] is None  # nothing stamped for a refused write


async def test_workers_handing_on_through_the_terminal_write_strand_nothing(
    services: Any, redis_client: Any
) -> None:
    """The big batch again, each message run by the real runtime (claim, handler, terminal write
    that picks the freed slot's next task, publish): every task runs, one message each."""
    s = services.settings
    s.publish_ahead = 2
    s.worker_run_next = 0  # every id through the broker
    outcomes = await Submitter(services).submit_many(
        [TaskIntent("diagnostics.noop", {"n": i}) for i in range(40)]
    )
    assert sum(o.published for o in outcomes) == s.capacity + 2  # type: ignore[union-attr]
    messages = await _run_messages(services, redis_client)
    summary = await services.repo.summary()
    assert summary["by_status"]["success"] == 40 and summary["total"] == 40  # nothing stranded
    assert messages == 40  # one message per task


async def _run_messages(services: Any, redis_client: Any, queue: str = "durable") -> int:
    """Run every message on ``queue`` through the real runtime until none is left; how many ran."""
    import json

    from tasks_core.worker.runtime import run_task

    messages = 0
    while (raw := redis_client.rpop(queue)) is not None:
        messages += 1
        outcome = await run_task(services, json.loads(raw)["headers"]["argsrepr"].strip("[]'(),"))
        assert outcome.claimed and outcome.status == "success", outcome
    return messages


async def test_a_worker_runs_the_tasks_its_terminal_writes_pick_without_their_messages(
    services: Any, redis_client: Any
) -> None:
    """DTASK_WORKER_RUN_NEXT: the process whose terminal write picked the freed slot's next task
    claims and runs it itself. Every task still runs once, under an attempt of its own."""
    s = services.settings
    s.publish_ahead = 0
    s.worker_run_next = 100
    await Submitter(services).submit_many([TaskIntent("diagnostics.noop", {"n": i}) for i in range(40)])
    assert redis_client.llen("durable") == s.capacity  # what the slots can take, nothing more
    messages = await _run_messages(services, redis_client)
    summary = await services.repo.summary()
    assert summary["by_status"]["success"] == 40 and summary["total"] == 40  # nothing stranded
    assert messages == s.capacity  # the rest ran without a message of their own
    attempts = await attempt_rows(services.engine)
    assert len(attempts) == 40 and len({a["task_id"] for a in attempts}) == 40
    assert len({a["token"] for a in attempts}) == 40  # each claimed afresh
    # one after another: each attempt ended before the next one taken on began
    for earlier, later in itertools.pairwise(attempts):
        assert earlier["ended_at"] <= later["claimed_at"]


async def test_a_worker_takes_on_at_most_run_next_tasks_then_sends_the_next_pick(
    services: Any, redis_client: Any
) -> None:
    from tasks_core.worker.runtime import run_task

    s = services.settings
    s.capacity, s.publish_ahead, s.worker_run_next = 1, 0, 2
    ids = [o.task_id for o in await Submitter(services).submit_many(  # type: ignore[union-attr]
        [TaskIntent("diagnostics.noop", {"n": i}) for i in range(5)])]
    assert redis_client.llen("durable") == 1
    redis_client.delete("durable")
    assert (await run_task(services, str(ids[0]))).status == "success"
    done = [(await services.repo.get(i))["status"] for i in ids]
    assert done == ["success", "success", "success", "pending", "pending"]  # its own task + 2
    sent = [m.decode() for m in redis_client.lrange("durable", 0, -1)]
    assert len(sent) == 1 and str(ids[3]) in sent[0]  # the fourth goes through the broker


async def test_a_worker_asked_to_stop_takes_nothing_on_and_sends_its_pick(
    services: Any, redis_client: Any
) -> None:
    """A warm shutdown: the running task finishes within its grace period, and the slot it frees
    goes through the broker to a worker that is staying."""
    import asyncio

    from tasks_core.worker.runtime import ShutdownSignal, run_task

    s = services.settings
    s.capacity, s.publish_ahead, s.worker_run_next = 1, 0, 100
    sleeper = await Submitter(services).submit(TaskIntent("diagnostics.sleep", {"seconds": 0.3, "steps": 1}))
    waiting = await Submitter(services).submit(TaskIntent("diagnostics.noop"))
    redis_client.delete("durable")
    shutdown = ShutdownSignal()
    asyncio.get_running_loop().call_later(0.1, shutdown.set)
    assert (await run_task(services, str(sleeper.task_id), shutdown)).status == "success"
    assert (await services.repo.get(waiting.task_id))["status"] == "pending"
    sent = [m.decode() for m in redis_client.lrange("durable", 0, -1)]
    assert len(sent) == 1 and str(waiting.task_id) in sent[0]


async def test_a_pick_routed_to_another_queue_is_sent_there_not_taken_on(
    services: Any, redis_client: Any
) -> None:
    import dataclasses

    from domains.diagnostics.tasks import SPECS
    from tasks_core.registry import Registry, TaskSpec
    from tasks_core.worker.runtime import run_task

    cpu_spec = TaskSpec("test.cpu", "domains.diagnostics.handlers:noop", queue="durable-cpu")
    registry = Registry([*SPECS, cpu_spec])
    svc = dataclasses.replace(services, registry=registry)
    s = svc.settings
    s.capacity, s.publish_ahead, s.worker_run_next = 1, 0, 100
    first = await Submitter(svc).submit(TaskIntent("diagnostics.noop"))
    cpu = await Submitter(svc).submit(TaskIntent("test.cpu"))
    redis_client.delete("durable")
    assert (await run_task(svc, str(first.task_id))).status == "success"
    assert (await svc.repo.get(cpu.task_id))["status"] == "pending"  # not run by a `durable` worker
    assert redis_client.llen("durable") == 0 and redis_client.llen("durable-cpu") == 1


async def test_under_the_workers_generic_plans_the_budget_and_the_pick_read_their_indexes(
    services: Any,
) -> None:
    """Workers plan generically (DTASK_WORKER_PLAN_CACHE_MODE). The budget's count of messages in
    flight must still read ix_tasks_in_flight and the relay's pick ix_tasks_unpublished, never the
    pending rows: counting in flight over them cost 26 ms per relay at 100 k pending."""
    import json

    import asyncpg
    from sqlalchemy import text

    from tasks_core.store.base import runnable_arrays as _runnable_arrays
    from tasks_core.store.statements import FINISH_SQL, RELAY_DUE_SQL

    async with services.engine.begin() as conn:
        await conn.execute(text(
            """INSERT INTO tasks (id, task_type, handler_version, payload, status, timeout_seconds,
                                  created_at, last_published_at)
            SELECT gen_random_uuid(), 'diagnostics.noop', 1, '{}', 'pending', 60,
                   clock_timestamp() - make_interval(secs => i),
                   CASE WHEN i <= 8 THEN clock_timestamp() END  -- capacity + ahead in flight
            FROM generate_series(1, 20000) AS i"""
        ))
        await conn.execute(text("ANALYZE tasks"))
    params = {"now": None, "cap": 4, "ahead": 4, "window": 60.0, "limit": 500, "omax": None,
              **_runnable_arrays(services.registry), "id": uuid.uuid4(), "tok": uuid.uuid4(),
              "status": "success", "outcome": "success", "detail": None, "result": "{}", "error": None,
              "cancelled": "{}"}
    dsn = services.settings.database_url.replace("+asyncpg", "")
    raw = await asyncpg.connect(dsn, server_settings={"plan_cache_mode": "force_generic_plan"})
    try:
        for statement in (RELAY_DUE_SQL, FINISH_SQL):
            prepared = await raw.prepare(statement.query)
            plan = json.dumps(await prepared.explain(*statement.args(params)))
            assert "ix_tasks_in_flight" in plan, plan
            assert "ix_tasks_unpublished" in plan, plan
    finally:
        await raw.close()
