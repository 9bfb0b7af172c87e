"""Submission: validate, commit, and only then publish; dedupe under concurrency (I4)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any

import pytest
from repo_helpers import claim, scalar, task_row
from repo_helpers import submit as store
from sqlalchemy import text as sa_text

from tasks_core.model import Status
from tasks_core.submission import MAX_BATCH, InvalidTask, Submitted, Submitter, TaskIntent, validate

QUEUE = "durable"  # kombu's Redis transport keeps a queue's messages in a list of this name

VALID = TaskIntent("diagnostics.noop", {"hello": "world"})


def _bad(field: str, case: str, task_type: Any = "diagnostics.noop", **fields: Any) -> Any:
    return pytest.param(TaskIntent(task_type, **fields), field, id=case)


INVALID = [
    _bad("task_type", "unknown-type", "no.such.type"),
    _bad("task_type", "empty-type", ""),
    _bad("task_type", "type-not-a-string", None),
    _bad("handler_version", "newer-version", handler_version=2),
    _bad("handler_version", "legacy-version", handler_version=0),
    _bad("handler_version", "version-as-string", handler_version="1"),
    _bad("handler_version", "version-as-bool", handler_version=True),
    _bad("payload", "payload-list", payload=[1, 2]),
    _bad("payload", "payload-string", payload="{}"),
    _bad("payload", "payload-none", payload=None),
    _bad("payload", "payload-nan", payload={"x": math.nan}),
    _bad("payload", "payload-unserializable", payload={"x": {1, 2}}),
    _bad("payload", "payload-too-big", payload={"blob": "x" * 200}),
    _bad("timeout_seconds", "timeout-nan", timeout_seconds=math.nan),
    _bad("timeout_seconds", "timeout-inf", timeout_seconds=math.inf),
    _bad("timeout_seconds", "timeout-negative", timeout_seconds=-5),
    _bad("timeout_seconds", "timeout-zero", timeout_seconds=0),
    _bad("timeout_seconds", "timeout-zero-float", timeout_seconds=0.0),
    _bad("timeout_seconds", "timeout-too-large", timeout_seconds=1001),
    _bad("timeout_seconds", "timeout-bool", timeout_seconds=True),
    _bad("timeout_seconds", "timeout-string", timeout_seconds="60"),
    _bad("dedupe_key", "dedupe-key-too-long", dedupe_key="k" * 33),
    _bad("dedupe_key", "dedupe-key-empty", dedupe_key=""),
    _bad("dedupe_key", "dedupe-key-not-a-string", dedupe_key=7),
]


def _tight(services: Any, settings_factory: Any) -> Any:
    """The same services with small limits: 100-byte payloads, 1000 s timeouts, 32-char keys."""
    return dataclasses.replace(
        services,
        settings=settings_factory(max_payload_bytes=100, max_timeout_seconds=1000, max_dedupe_key_length=32),
    )


@pytest.mark.parametrize(("intent", "field"), INVALID)
async def test_invalid_intent_is_rejected_and_nothing_is_stored_or_published(
    services: Any, settings_factory: Any, redis_client: Any, intent: TaskIntent, field: str
) -> None:
    svc = _tight(services, settings_factory)
    with pytest.raises(InvalidTask) as raised:
        validate(intent, svc.registry, svc.settings, owner="alice")
    assert raised.value.field == field

    with pytest.raises(InvalidTask) as raised:
        await Submitter(svc).submit(intent, owner="alice")
    assert raised.value.field == field
    assert await scalar(svc.engine, "SELECT count(*) FROM tasks") == 0
    assert redis_client.llen(QUEUE) == 0


async def test_limits_are_inclusive_and_defaults_come_from_the_spec(
    services: Any, settings_factory: Any
) -> None:
    svc = _tight(services, settings_factory)
    at_limits = TaskIntent(
        "diagnostics.noop",
        {"b": "x" * (100 - len('{"b": ""}'))},
        handler_version=1,
        dedupe_key="k" * 32,
        timeout_seconds=1000,
    )
    new = validate(at_limits, svc.registry, svc.settings, owner="alice")
    assert (new.timeout_seconds, new.dedupe_key, new.owner) == (1000.0, "k" * 32, "alice")
    # No timeout given: the spec's own (60 s for diagnostics.noop); no version: the current one.
    new = validate(TaskIntent("diagnostics.noop"), svc.registry, svc.settings, owner=None)
    assert (new.timeout_seconds, new.handler_version, new.payload) == (60.0, 1, {})
    # A spec without a timeout gets the default, capped by the maximum (3600 s default > 1000 s max).
    assert (
        validate(TaskIntent("diagnostics.sleep"), svc.registry, svc.settings, None).timeout_seconds == 1000.0
    )


async def test_submit_commits_then_publishes_the_id(services: Any, redis_client: Any) -> None:
    result = await Submitter(services).submit(VALID, owner="alice")
    assert result.published and result.publish_error is None and result.duplicate_of is None
    row = await task_row(services.engine, result.task_id)
    assert (row["status"], row["payload"], row["owner"]) == ("pending", {"hello": "world"}, "alice")
    assert row["last_published_at"] is not None
    assert redis_client.llen(QUEUE) == 1


async def test_submit_many_commits_the_valid_entries_together_and_publishes_them(
    services: Any, settings_factory: Any, redis_client: Any
) -> None:
    svc = _tight(services, settings_factory)
    intents = [
        TaskIntent("diagnostics.noop", {"n": 1}),
        TaskIntent("no.such.type"),
        TaskIntent("diagnostics.sleep", {"seconds": 0}, timeout_seconds=10),
        TaskIntent("diagnostics.noop", timeout_seconds=-1),
        TaskIntent("diagnostics.noop", {"n": 3}, dedupe_key="once"),
        TaskIntent("diagnostics.noop", {"n": 4}, dedupe_key="once"),  # same key, same batch
        TaskIntent("diagnostics.fail", payload=["not", "a", "dict"]),
    ]
    outcomes = await Submitter(svc).submit_many(intents, owner="bob")

    assert [type(o).__name__ for o in outcomes] == [
        "Submitted",
        "InvalidTask",
        "Submitted",
        "InvalidTask",
        "Submitted",
        "Submitted",
        "InvalidTask",
    ]
    assert [o.field for o in outcomes if isinstance(o, InvalidTask)] == [
        "task_type",
        "timeout_seconds",
        "payload",
    ]
    accepted = [o for o in outcomes if isinstance(o, Submitted)]
    new = [o for o in accepted if o.duplicate_of is None]
    assert len(new) == 3 and all(o.published for o in new)
    assert accepted[3].duplicate_of == accepted[2].task_id == accepted[3].task_id
    assert not accepted[3].published  # nothing new was stored for it, so nothing was sent

    stored = await scalar(svc.engine, "SELECT array_agg(id) FROM tasks WHERE owner = 'bob'")
    assert sorted(stored) == sorted(o.task_id for o in new)
    assert await scalar(svc.engine, "SELECT count(*) FROM tasks") == 3
    assert await scalar(svc.engine, "SELECT count(*) FROM tasks WHERE last_published_at IS NULL") == 0
    assert redis_client.llen(QUEUE) == 3


async def test_submit_many_over_the_batch_limit_stores_nothing(services: Any, redis_client: Any) -> None:
    with pytest.raises(InvalidTask):
        await Submitter(services).submit_many([VALID] * (MAX_BATCH + 1))
    assert await scalar(services.engine, "SELECT count(*) FROM tasks") == 0
    assert redis_client.llen(QUEUE) == 0


@pytest.mark.parametrize("group_max", [1000, 1], ids=["one-group-commit", "a-transaction-each"])
async def test_twenty_concurrent_submits_of_one_dedupe_key_make_one_task(
    services: Any, settings_factory: Any, redis_client: Any, group_max: int
) -> None:
    """I4: 20 submitters racing with one (type, dedupe_key) leave exactly one active task; every
    other answer names it as duplicate_of. Once that task is terminal the key is free again. The
    racers share one statement (group commit) or race in 20 transactions of their own."""
    services = dataclasses.replace(services, settings=settings_factory(submit_group_max=group_max))
    submitter = Submitter(services)
    intent = TaskIntent("diagnostics.sleep", {"seconds": 1}, dedupe_key="nightly-reindex")
    gate = asyncio.Event()

    async def one() -> Submitted:
        await gate.wait()
        return await submitter.submit(intent)

    racers = [asyncio.ensure_future(one()) for _ in range(20)]
    await asyncio.sleep(0)
    gate.set()
    results = await asyncio.gather(*racers)

    winners = [r for r in results if r.duplicate_of is None]
    assert len(winners) == 1
    holder = winners[0].task_id
    assert all(r.duplicate_of == holder == r.task_id for r in results if r is not winners[0])
    assert (
        await scalar(
            services.engine,
            """SELECT count(*) FROM tasks WHERE task_type = 'diagnostics.sleep'
           AND dedupe_key = 'nightly-reindex' AND status IN ('pending', 'running')""",
        )
        == 1
    )
    assert await scalar(services.engine, "SELECT count(*) FROM tasks") == 1
    assert redis_client.llen(QUEUE) == 1  # only the new task was published

    # Still held while running...
    got = await claim(services.repo, services.registry, holder)
    again = await submitter.submit(intent)
    assert again.duplicate_of == holder
    # ... released by the terminal transition: the next submit creates a new task.
    await services.repo.finish(holder, got.token, services.registry, status=Status.SUCCESS, result={})
    fresh = await submitter.submit(intent)
    assert fresh.duplicate_of is None and fresh.task_id != holder
    assert (await task_row(services.engine, fresh.task_id))["status"] == "pending"
    # The same key under another type is an independent key.
    other = await submitter.submit(TaskIntent("diagnostics.noop", dedupe_key="nightly-reindex"))
    assert other.duplicate_of is None
    assert redis_client.llen(QUEUE) == 3


async def test_dedupe_key_is_freed_by_every_terminal_status(services: Any) -> None:
    """I4: failed and cancelled release the key as success does; no key never dedupes."""
    repo, reg = services.repo, services.registry
    failed = await store(repo, dedupe_key="k")
    got = await claim(repo, reg, failed)
    await repo.finish(failed, got.token, reg, status=Status.FAILED, error={"code": "x", "message": "y"})
    cancelled = await store(repo, dedupe_key="k")
    assert await repo.request_cancel(cancelled, reg) == "cancelled"
    third = await store(repo, dedupe_key="k")
    assert len({failed, cancelled, third}) == 3
    assert len({await store(repo), await store(repo)}) == 2


async def test_nothing_is_published_when_the_submitting_transaction_rolls_back(
    services: Any, redis_client: Any
) -> None:
    """Protocol 1: ids travel only after commit. A domain write failing after the task was added
    rolls the task back too, and no id reaches the broker."""

    class DomainWriteFailed(Exception):
        pass

    with pytest.raises(DomainWriteFailed):
        async with Submitter(services).transaction(owner="alice") as tx:
            await tx.add(VALID)
            raise DomainWriteFailed
    assert await scalar(services.engine, "SELECT count(*) FROM tasks") == 0
    assert redis_client.llen(QUEUE) == 0


async def test_unreachable_broker_leaves_the_pending_fact_and_reports_it(services: Any) -> None:
    """Protocol 1: a publish failure is reported, not raised; the committed row stays pending with
    the failure recorded, for the publisher to re-send."""
    from celery import Celery

    from tasks_core.transport import CeleryTransport

    dead = Celery("unreachable", broker="redis://127.0.0.1:1/0")
    svc = dataclasses.replace(services, transport=CeleryTransport(dead))
    result = await Submitter(svc).submit(VALID)
    assert result.published is False and result.publish_error
    row = await task_row(services.engine, result.task_id)
    assert row["status"] == "pending" and row["last_published_at"] is None
    assert row["publish_error"] == result.publish_error


async def test_a_submission_holds_one_pooled_connection_at_a_time(
    clean_db: None, settings_factory: Any, redis_client: Any
) -> None:
    """The committed connection goes back to the pool before the relay publishes: with a pool of
    one connection, concurrent submissions each commit and publish instead of waiting for a
    second connection while holding the first (the api answered 500 under 32 clients)."""
    from tasks_core.services import build_services

    svc = build_services(settings_factory(capacity=100), pool_size=1, max_overflow=0)
    try:
        results = await asyncio.wait_for(
            asyncio.gather(*(Submitter(svc).submit(VALID) for _ in range(8))), timeout=30
        )
        batch = await Submitter(svc).submit_many([VALID] * 3)
        unsent = await scalar(svc.engine, "SELECT count(*) FROM tasks WHERE last_published_at IS NULL")
    finally:
        await svc.close()
    # Each id went out once, by its own submission's relay or a concurrent one's.
    assert all(r.publish_error is None for r in results)
    assert all(isinstance(r, Submitted) and r.publish_error is None for r in batch)
    assert redis_client.llen(QUEUE) == 11
    assert unsent == 0


async def test_each_type_travels_on_its_own_queue_at_submit_and_from_the_publisher(
    services: Any, redis_client: Any
) -> None:
    """TaskSpec.queue routes a type's ids (submission and the publisher's re-send alike), so CPU-heavy
    types can go to prefork workers that consume only their queue."""
    from domains.diagnostics.tasks import SPECS
    from tasks_core.duties.publisher import publish_pending
    from tasks_core.registry import Registry, TaskSpec

    cpu_spec = TaskSpec("test.cpu", "domains.diagnostics.handlers:noop", queue="durable-cpu")
    registry = Registry([*SPECS, cpu_spec])
    svc = dataclasses.replace(services, registry=registry)
    cpu = await Submitter(svc).submit(TaskIntent("test.cpu"))
    await Submitter(svc).submit(VALID)
    assert isinstance(cpu, Submitted) and cpu.publish_error is None
    assert redis_client.llen("durable-cpu") == 1 and redis_client.llen(QUEUE) == 1
    assert str(cpu.task_id) in redis_client.lindex("durable-cpu", 0).decode()

    # Sent again by the publisher (a lost message): still on its own queue only.
    async with svc.engine.begin() as conn:
        await conn.execute(sa_text("UPDATE tasks SET last_published_at = NULL"))
    redis_client.delete("durable-cpu", QUEUE)
    await publish_pending(svc)
    assert redis_client.llen("durable-cpu") == 1 and redis_client.llen(QUEUE) == 1
