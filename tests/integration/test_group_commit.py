"""Group commit of single submissions on real PostgreSQL: concurrent Submitter.submit calls share
transactions, each caller still gets its own task, and no caller's intent is lost, doubled or
stranded by another's."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from repo_helpers import scalar, wait_until_blocked_on_a_lock
from sqlalchemy import text

from tasks_core.store.outcomes import NewTask
from tasks_core.submission import Submitter, TaskIntent

QUEUE = "durable"


async def test_concurrent_submissions_share_transactions_and_each_gets_its_own_task(
    services: Any, redis_client: Any
) -> None:
    submitter = Submitter(services)
    results = await asyncio.gather(
        *(submitter.submit(TaskIntent("diagnostics.noop", {"i": i}), owner=f"o{i % 3}") for i in range(64))
    )
    rows = {
        r.id: (r.payload, r.owner)
        for r in (await _conn_rows(services, "SELECT id, payload, owner FROM tasks"))
    }
    assert len(rows) == 64
    for i, result in enumerate(results):
        assert result.duplicate_of is None
        assert rows[result.task_id] == ({"i": i}, f"o{i % 3}")
        assert result.row is not None and result.row["id"] == result.task_id
    groups = services.submit_group.groups
    assert 1 <= groups < 64  # a lone first group, then the others together
    # What capacity could take went out, once each; the rest wait unsent for a freed slot.
    published = [r.task_id for r in results if r.published]
    assert len(published) == services.settings.capacity == redis_client.llen(QUEUE)
    stamped = "SELECT count(*) FROM tasks WHERE last_published_at IS NOT NULL"
    assert await scalar(services.engine, stamped) == len(published)


async def test_a_payload_postgresql_refuses_fails_only_its_own_submission(services: Any) -> None:
    """validate() refuses U+0000, so the bad entry is built past it: it is what a check we missed
    would let through. Its group fails as a whole, then goes again entry by entry."""
    group = Submitter(services)._group()
    good = [NewTask("diagnostics.noop", 1, {"i": i}, 60.0) for i in range(5)]
    bad = NewTask("diagnostics.noop", 1, {"s": "nul \x00 byte"}, 60.0)
    outcomes = await asyncio.gather(*(group(n) for n in [*good[:2], bad, *good[2:]]), return_exceptions=True)
    failed = outcomes.pop(2)
    assert isinstance(failed, Exception) and "\\u0000" in str(failed)
    stored = {r.id for r in await _conn_rows(services, "SELECT id FROM tasks")}
    assert stored == {o.task_id for o in outcomes}
    assert len(stored) == 5


async def test_a_submission_cancelled_while_it_waits_for_the_next_group_stores_nothing(
    services: Any,
) -> None:
    """The group ahead waits on a dedupe key an open transaction holds; a caller that gives up
    while queued behind it (its client went away) never reaches the database."""
    submitter = Submitter(services)
    async with services.engine.connect() as holder:
        tx = await holder.begin()
        await holder.execute(text(
            """INSERT INTO tasks (id, task_type, handler_version, payload, status, dedupe_key,
                                  timeout_seconds)
            VALUES (gen_random_uuid(), 'diagnostics.noop', 1, '{}', 'pending', 'held', 60)"""
        ))
        ahead = asyncio.ensure_future(submitter.submit(TaskIntent("diagnostics.noop", dedupe_key="held")))
        await wait_until_blocked_on_a_lock(services.engine)
        queued = asyncio.ensure_future(submitter.submit(TaskIntent("diagnostics.noop", {"who": "queued"})))
        await asyncio.sleep(0.05)
        queued.cancel()
        await tx.rollback()
    assert (await ahead).duplicate_of is None  # the key was free again after the rollback
    with pytest.raises(asyncio.CancelledError):
        await queued
    await asyncio.sleep(0.1)
    assert await scalar(services.engine, "SELECT count(*) FROM tasks WHERE payload ? 'who'") == 0
    assert await scalar(services.engine, "SELECT count(*) FROM tasks") == 1


async def test_an_owner_quota_keeps_each_submission_in_a_transaction_of_its_own(
    services: Any, settings_factory: Any
) -> None:
    """The quota locks the owner's count per request, so quota'd submissions are not grouped."""
    services = dataclasses.replace(services, settings=settings_factory(owner_max_pending=3))
    submitter = Submitter(services)
    outcomes = await asyncio.gather(
        *(submitter.submit(TaskIntent("diagnostics.noop"), owner="tenant") for _ in range(5)),
        return_exceptions=True,
    )
    assert sum(not isinstance(o, Exception) for o in outcomes) == 3
    assert services.submit_group is None


async def _conn_rows(services: Any, sql: str) -> list[Any]:
    async with services.engine.connect() as conn:
        return list(await conn.execute(text(sql)))
