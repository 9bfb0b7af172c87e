"""The scheduler duty against the real database: each (schedule, slot) creates one task, whatever
runs twice (a second pass, concurrent passes, a pass that died before its commit, a pass that got
past the lock), downtime makes one catch-up task, paused schedules make none and resume without a
burst, and a schedule's tasks carry its owner and priority, pending from the slot's instant on.

"Now" is pinned through the repository (``repo.now``, which ScheduleStore.of shares), so every
slot is exact; the rows, locks and conflicts are PostgreSQL's.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import text

from tasks_core.duties.scheduler import fire_due
from tasks_core.schedules import ScheduleIntent, validate_schedule
from tasks_core.store.schedules import Fire, ScheduleStore
from tests.integration.repo_helpers import scalar, wait_until_blocked_on_a_lock

T0 = datetime(2030, 6, 1, 12, 0, 0, tzinfo=UTC)


async def add(services: Any, name: str = "tick", owner: str = "alice", **rule: Any) -> dict[str, Any]:
    rule = rule or {"every_seconds": 60}
    priority = rule.pop("priority", 0)
    intent = ScheduleIntent(name, "diagnostics.noop", {"from": name}, priority=priority, **rule)
    new = validate_schedule(intent, services.registry, services.settings, owner, admin=True)
    row = await ScheduleStore.of(services).create(new)
    assert row is not None
    return row


async def tasks_of(services: Any, schedule: dict[str, Any]) -> list[dict[str, Any]]:
    async with services.engine.connect() as conn:
        rows = await conn.execute(
            text(
                """SELECT t.*, r.slot_at FROM schedule_runs r JOIN tasks t ON t.id = r.task_id
                WHERE r.schedule_id = :id ORDER BY r.slot_at"""
            ),
            {"id": schedule["id"]},
        )
        return [dict(r) for r in rows.mappings()]


async def task_count(services: Any) -> int:
    return int(await scalar(services.engine, "SELECT count(*) FROM tasks"))


async def test_a_due_slot_becomes_one_pending_task_of_the_owner_and_the_schedule_moves_on(
    services: Any,
) -> None:
    services.repo.now = T0
    schedule = await add(services, every_seconds=60, priority=7)
    assert schedule["next_run_at"] == T0 + timedelta(seconds=60)
    assert (await fire_due(services)).created == 0  # not due yet

    services.repo.now = T0 + timedelta(seconds=61)
    report = await fire_due(services)
    assert (report.due, report.created) == (1, 1)
    [task] = await tasks_of(services, schedule)
    assert task["owner"] == "alice" and task["priority"] == 7 and task["payload"] == {"from": "tick"}
    assert task["run_at"] == task["not_before"] == task["slot_at"] == T0 + timedelta(seconds=60)
    assert task["task_type"] == "diagnostics.noop" and task["handler_version"] == 1
    assert task["created_at"] == services.repo.now
    # The relay took it at once, like a submission's (stamped and sent, or marked for the publisher
    # when the broker did not answer in time).
    assert task["status"] == "pending"
    assert task["last_published_at"] == services.repo.now or task["publish_error"] is not None
    after = (await ScheduleStore.of(services).find("tick", "alice"))[0]
    assert after["next_run_at"] == T0 + timedelta(seconds=120) and after["last_fired_at"] == services.repo.now


async def test_the_pass_run_twice_for_one_slot_makes_one_task(services: Any) -> None:
    services.repo.now = T0
    schedule = await add(services, every_seconds=60)
    services.repo.now = T0 + timedelta(seconds=90)
    assert (await fire_due(services)).created == 1
    assert (await fire_due(services)).created == 0
    assert len(await tasks_of(services, schedule)) == 1


async def test_concurrent_passes_for_one_due_slot_make_one_task(services: Any) -> None:
    services.repo.now = T0
    schedules = [await add(services, f"s{i}", every_seconds=60) for i in range(5)]
    services.repo.now = T0 + timedelta(seconds=60)
    reports = await asyncio.gather(*(fire_due(services) for _ in range(6)))
    assert sum(r.created for r in reports) == 5
    for schedule in schedules:
        assert len(await tasks_of(services, schedule)) == 1


async def test_a_pass_holding_the_lock_makes_others_skip_and_still_one_task(services: Any) -> None:
    services.repo.now = T0
    schedule = await add(services, every_seconds=60)
    services.repo.now = T0 + timedelta(seconds=60)
    store = ScheduleStore.of(services)
    async with services.engine.connect() as conn, conn.begin():
        [due] = await store.due(conn, 10)  # this pass holds the schedule
        other = await asyncio.wait_for(fire_due(services), 5)  # skips it, never waits
        assert (other.due, other.created) == (0, 0)
        slot, nxt = (T0 + timedelta(seconds=60), T0 + timedelta(seconds=120))
        await store.fire(conn, [Fire(due["id"], slot, nxt, uuid.uuid4(), 1, 60.0)])
    assert (await fire_due(services)).created == 0
    assert len(await tasks_of(services, schedule)) == 1


async def test_the_slot_key_refuses_a_second_task_even_past_the_lock(services: Any) -> None:
    """Two passes that both decided to fire one slot (a beat whose advance of next_run_at was lost,
    a restored row): the second waits on the first's slot row, then inserts nothing."""
    services.repo.now = T0
    schedule = await add(services, every_seconds=60)
    store = ScheduleStore.of(services)
    slot, nxt = T0 + timedelta(seconds=60), T0 + timedelta(seconds=120)
    async with services.engine.connect() as first, first.begin():
        assert len(await store.fire(first, [Fire(schedule["id"], slot, nxt, uuid.uuid4(), 1, 60.0)])) == 1

        async def second() -> list[Any]:
            async with services.engine.connect() as conn, conn.begin():
                return await store.fire(conn, [Fire(schedule["id"], slot, nxt, uuid.uuid4(), 1, 60.0)])

        racing = asyncio.create_task(second())
        await wait_until_blocked_on_a_lock(services.engine)
    assert await racing == []
    # And a pass that finds next_run_at put back to a slot already fired makes nothing either.
    async with services.engine.begin() as conn:
        await conn.execute(text("UPDATE schedules SET next_run_at = :slot"), {"slot": slot})
    services.repo.now = slot
    report = await fire_due(services)
    assert (report.due, report.created) == (1, 0)
    assert len(await tasks_of(services, schedule)) == 1 and await task_count(services) == 1


async def test_a_pass_that_died_before_its_commit_leaves_the_slot_to_the_next_one(services: Any) -> None:
    """A beat (or worker) restarted mid-slot: its pass rolled back, the next pass fires the slot once."""
    services.repo.now = T0
    schedule = await add(services, every_seconds=60)
    services.repo.now = T0 + timedelta(seconds=60)
    store = ScheduleStore.of(services)
    conn = await services.engine.connect()
    await conn.begin()
    [due] = await store.due(conn, 10)
    await store.fire(
        conn,
        [Fire(due["id"], T0 + timedelta(seconds=60), T0 + timedelta(seconds=120), uuid.uuid4(), 1, 60.0)],
    )
    await conn.invalidate()  # the connection dies with its transaction
    await conn.close()
    assert await task_count(services) == 0
    assert (await fire_due(services)).created == 1
    assert (await fire_due(services)).created == 0
    [task] = await tasks_of(services, schedule)
    assert task["slot_at"] == T0 + timedelta(seconds=60)


async def test_downtime_of_many_slots_makes_one_catch_up_task_for_the_latest(services: Any) -> None:
    services.repo.now = T0
    interval = await add(services, "every", every_seconds=60)
    hourly = await add(services, "hourly", cron="0 * * * *")
    services.repo.now = T0 + timedelta(hours=5, seconds=30)  # 300 interval slots and 5 hours missed
    assert (await fire_due(services)).created == 2
    [caught_up] = await tasks_of(services, interval)
    assert caught_up["slot_at"] == T0 + timedelta(hours=5)
    [hour] = await tasks_of(services, hourly)
    assert hour["slot_at"] == T0 + timedelta(hours=5)
    rows = {r["name"]: r for r in await ScheduleStore.of(services).listed(None)}
    assert rows["every"]["next_run_at"] == T0 + timedelta(hours=5, seconds=60)
    assert rows["hourly"]["next_run_at"] == T0 + timedelta(hours=6)
    assert (await fire_due(services)).created == 0


async def test_a_paused_schedule_makes_nothing_and_resumes_from_now_without_a_burst(services: Any) -> None:
    services.repo.now = T0
    schedule = await add(services, every_seconds=60)
    store = ScheduleStore.of(services)
    paused = await store.pause(schedule["id"])
    assert paused is not None and paused["paused_at"] == T0
    assert (await store.pause(schedule["id"]))["paused_at"] == T0  # pausing again changes nothing
    services.repo.now = T0 + timedelta(hours=2, seconds=10)
    assert (await fire_due(services)).due == 0 and await task_count(services) == 0
    resumed = await store.resume(schedule["id"])
    assert resumed is not None and resumed["paused_at"] is None
    assert resumed["next_run_at"] == T0 + timedelta(hours=2, seconds=60)  # the next slot on its grid
    assert (await fire_due(services)).created == 0  # nothing missed while paused fires
    services.repo.now = T0 + timedelta(hours=2, seconds=60)
    assert (await fire_due(services)).created == 1
    assert [t["slot_at"] for t in await tasks_of(services, schedule)] == [T0 + timedelta(hours=2, seconds=60)]


async def test_cron_in_a_zone_fires_at_local_time(services: Any) -> None:
    services.repo.now = datetime(2030, 3, 9, 12, tzinfo=UTC)  # the eve of New York's spring forward
    schedule = await add(services, cron="30 2 * * *", timezone="America/New_York")
    assert schedule["next_run_at"] == datetime(2030, 3, 10, 7, 0, tzinfo=UTC)  # 03:00 EDT: 02:30 is skipped
    services.repo.now = datetime(2030, 3, 10, 7, 0, 5, tzinfo=UTC)
    assert (await fire_due(services)).created == 1
    after = (await ScheduleStore.of(services).find("tick", "alice"))[0]
    assert after["next_run_at"] == datetime(2030, 3, 11, 6, 30, tzinfo=UTC)  # 02:30 EDT


async def test_a_slot_whose_type_is_gone_makes_no_task_and_says_why(services: Any) -> None:
    services.repo.now = T0
    schedule = await add(services, every_seconds=60)
    async with services.engine.begin() as conn:
        await conn.execute(text("UPDATE schedules SET task_type = 'gone.type'"))
    services.repo.now = T0 + timedelta(seconds=60)
    report = await fire_due(services)
    assert (report.due, report.created) == (1, 0)
    row = (await ScheduleStore.of(services).find("tick", "alice"))[0]
    assert "unknown task type 'gone.type'" in row["last_error"]
    assert row["next_run_at"] == T0 + timedelta(seconds=120)  # it moves on, and tries again next slot
    assert await tasks_of(services, schedule) == []


async def test_a_slot_whose_payload_no_longer_fits_its_schema_makes_no_task(services: Any) -> None:
    services.repo.now = T0
    schedule = await add(services, every_seconds=60)
    async with services.engine.begin() as conn:  # as if the type's payload model had changed since
        await conn.execute(
            text("""UPDATE schedules SET task_type = 'diagnostics.sleep', payload = '{"seconds": "x"}'""")
        )
    services.repo.now = T0 + timedelta(seconds=60)
    assert (await fire_due(services)).created == 0
    row = (await ScheduleStore.of(services).find("tick", "alice"))[0]
    assert row["last_error"].startswith("payload no longer valid: seconds:"), row["last_error"]
    async with services.engine.begin() as conn:  # fixed: the next slot fires, and the error clears
        await conn.execute(text("""UPDATE schedules SET payload = '{"seconds": 0}'"""))
    services.repo.now = T0 + timedelta(seconds=120)
    assert (await fire_due(services)).created == 1
    assert (await ScheduleStore.of(services).find("tick", "alice"))[0]["last_error"] is None
    [task] = await tasks_of(services, schedule)
    assert task["task_type"] == "diagnostics.sleep" and task["timeout_seconds"] == 6 * 3600


async def test_names_are_per_owner_and_deleting_keeps_the_tasks(services: Any) -> None:
    services.repo.now = T0
    mine = await add(services, "report", "alice")
    await add(services, "report", "bob")  # another owner's name never collides
    intent = ScheduleIntent("report", "diagnostics.noop", {}, every_seconds=60)
    again = validate_schedule(intent, services.registry, services.settings, "alice", admin=True)
    assert await ScheduleStore.of(services).create(again) is None
    services.repo.now = T0 + timedelta(seconds=60)
    assert (await fire_due(services)).created == 2
    await ScheduleStore.of(services).delete(mine["id"])
    assert await task_count(services) == 2
    assert await scalar(services.engine, "SELECT count(*) FROM schedule_runs") == 1
