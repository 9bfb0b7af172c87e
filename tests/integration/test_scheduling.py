"""Run later and run first: a scheduled task is claimable from its instant on (PostgreSQL's clock),
published when due and not before, and among claimable tasks the higher priority goes first.

"Now" is pinned through the repository (``repo.now``) so the instants are exact; the rows and
answers are the real database's.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tasks_core.store.outcomes import Claim, NewTask, RelayOptions
from tasks_core.submission import InvalidTask, Submitter, TaskIntent, validate
from tests.integration.repo_helpers import db_now


async def test_a_delayed_task_is_neither_published_nor_claimable_before_its_instant(
    services: Any, redis_client: Any
) -> None:
    repo, registry = services.repo, services.registry
    before = await db_now(services.engine)
    later = await Submitter(services).submit(TaskIntent("diagnostics.noop", {}, delay_seconds=600))
    row = await repo.get(later.task_id)
    # now + delay by PostgreSQL's clock, stored as the instant asked for and as its not_before
    assert (
        before + timedelta(seconds=600)
        <= row["run_at"]
        <= await db_now(services.engine) + timedelta(seconds=600)
    )
    assert row["not_before"] == row["run_at"] and not later.published
    assert later.waiting_reason().startswith("scheduled for ")
    assert redis_client.llen("durable") == 0  # no broker countdown: nothing sent yet

    assert await repo.claim(later.task_id, registry, capacity=4, lease_seconds=30) == "backoff"
    assert await repo.claim_for_publish(registry, limit=10, republish_after=30) == []
    reason = await repo.waiting_reason(await repo.get(later.task_id), 4)
    assert reason == f"scheduled for {row['run_at'].astimezone(UTC).isoformat().replace('+00:00', 'Z')}"

    repo.now = row["run_at"]  # due: the publisher takes it, and the claim succeeds
    assert await repo.claim_for_publish(registry, limit=10, republish_after=30) == [later.task_id]
    claim = await repo.claim(later.task_id, registry, capacity=4, lease_seconds=30)
    assert isinstance(claim, Claim)
    repo.now = None


async def test_run_at_is_an_instant_and_a_past_one_runs_at_once(services: Any) -> None:
    repo, registry = services.repo, services.registry
    instant = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    future = await Submitter(services).submit(
        TaskIntent("diagnostics.noop", {}, run_at="2030-01-02T04:04:05+01:00")
    )
    assert (await repo.get(future.task_id))["run_at"] == instant
    past = await Submitter(services).submit(
        TaskIntent("diagnostics.noop", {}, run_at=instant - timedelta(days=2000))
    )
    assert past.published
    assert isinstance(await repo.claim(past.task_id, registry, capacity=4, lease_seconds=30), Claim)


async def test_a_scheduled_task_can_be_cancelled_while_it_waits(services: Any) -> None:
    repo = services.repo
    later = await Submitter(services).submit(TaskIntent("diagnostics.noop", {}, delay_seconds=3600))
    await repo.request_cancel(later.task_id, services.registry)
    assert (await repo.get(later.task_id))["status"] == "cancelled"


async def test_higher_priority_is_published_and_relayed_first_then_older(services: Any) -> None:
    repo, registry = services.repo, services.registry
    services.settings.publish_ahead = 0
    # Fill the four slots, then queue work of mixed priority behind them (nothing else is sent).
    running = [
        (await Submitter(services).submit(TaskIntent("diagnostics.noop", {}))).task_id for _ in range(4)
    ]
    for task_id in running:
        assert isinstance(await repo.claim(task_id, registry, capacity=4, lease_seconds=30), Claim)
    order = [0, 5, -3, 5, 100, 0]
    waiting = [
        (await Submitter(services).submit(TaskIntent("diagnostics.noop", {"n": i}, priority=p))).task_id
        for i, p in enumerate(order)
    ]
    expected = [waiting[4], waiting[1], waiting[3], waiting[0], waiting[5], waiting[2]]
    taken = await repo.claim_for_publish(registry, limit=10, republish_after=None, capacity=None)
    assert taken == expected
    assert [(await repo.get(t))["priority"] for t in taken] == [100, 5, 5, 0, 0, -3]


async def test_the_terminal_write_hands_its_slot_to_the_highest_priority(services: Any) -> None:
    from tasks_core.model import Status

    repo, registry, s = services.repo, services.registry, services.settings
    s.publish_ahead = 0
    running = [
        (await Submitter(services).submit(TaskIntent("diagnostics.noop", {}))).task_id for _ in range(4)
    ]
    claims = [await repo.claim(t, registry, capacity=4, lease_seconds=30) for t in running]
    low = (await Submitter(services).submit(TaskIntent("diagnostics.noop", {}, priority=-1))).task_id
    high = (await Submitter(services).submit(TaskIntent("diagnostics.noop", {}, priority=7))).task_id
    assert isinstance(claims[0], Claim)
    relay = RelayOptions(registry, capacity=4, ahead=0, window=60.0, limit=1)
    finished = await repo.finish_and_relay(running[0], claims[0].token, registry, status=Status.SUCCESS,
                                           result={}, relay=relay)  # fmt: skip
    assert finished.relay == [(high, "diagnostics.noop")], finished
    assert (await repo.get(low))["last_published_at"] is None


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"run_at": "2030-01-01T00:00:00Z", "delay_seconds": 5}, "run_at", "not both"),
        ({"run_at": "2030-01-01T00:00:00"}, "run_at", "zone"),
        ({"run_at": "tomorrow"}, "run_at", "RFC 3339"),
        ({"run_at": 17}, "run_at", "RFC 3339"),
        ({"delay_seconds": float("inf")}, "delay_seconds", "finite"),
        ({"delay_seconds": -1}, "delay_seconds", "at least 0"),
        ({"delay_seconds": "5"}, "delay_seconds", "finite"),
        ({"delay_seconds": 1e12}, "delay_seconds", "at most"),
        ({"priority": 101}, "priority", "-100 to 100"),
        ({"priority": True}, "priority", "integer"),
        ({"priority": 1.5}, "priority", "integer"),
    ],
)
def test_bad_schedules_and_priorities_are_refused(
    services: Any, fields: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(InvalidTask) as refused:
        validate(TaskIntent("diagnostics.noop", {}, **fields), services.registry, services.settings, None)
    assert refused.value.field == field and words in refused.value.message


async def test_strict_priority_a_steady_stream_of_higher_work_keeps_lower_work_waiting(services: Any) -> None:
    """No aging (the README says so): while higher-priority work is always runnable, each freed slot
    goes to it, however long the lower task has waited; it runs once the stream pauses."""
    repo, registry = services.repo, services.registry

    async def insert(priority: int) -> Any:  # stored, not yet sent: what the relay picks from
        async with repo.engine.begin() as conn:
            new = NewTask("diagnostics.noop", 1, {}, 60.0, priority=priority)
            return (await repo.insert(conn, new)).id

    low = await insert(-1)
    for _ in range(50):  # each time a slot frees, a new high-priority task is there
        high = await insert(1)
        assert await repo.claim_for_publish(registry, limit=1, republish_after=None) == [high]
    assert await repo.claim_for_publish(registry, limit=1, republish_after=None) == [low]
