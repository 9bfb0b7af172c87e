"""Durable schedules with real `celery beat` and worker processes: an every-2-seconds schedule
makes tasks that run, and two beats at once (one of them killed and restarted mid-run) still make
exactly one task per slot, every slot on the schedule's grid."""

from __future__ import annotations

import asyncio
import json
import signal
from datetime import timedelta
from typing import Any

from sqlalchemy import text

from tasks_core.schedules import ScheduleIntent, validate_schedule
from tasks_core.store.schedules import ScheduleStore
from tests.system.conftest import STARTUP_TIMEOUT, Cluster, wait_for

EVERY = 2.0
# The scheduler's beat interval here: several passes per slot, so each slot is fired, not collapsed.
SCHEDULE_SECONDS = "0.5"


async def add(services: Any, name: str) -> dict[str, Any]:
    intent = ScheduleIntent(name, "diagnostics.noop", {"from": name}, every_seconds=EVERY)
    new = validate_schedule(intent, services.registry, services.settings, "alice", admin=True)
    row = await ScheduleStore.of(services).create(new)
    assert row is not None
    return row


async def tasks_by_slot(services: Any, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The schedule's tasks read from the task table alone (not through its slot rows)."""
    async with services.engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT * FROM tasks WHERE payload = CAST(:p AS jsonb) ORDER BY run_at, created_at"),
            {"p": json.dumps(payload)},
        )
        return [dict(r) for r in rows.mappings()]


async def test_an_every_two_seconds_schedule_makes_tasks_that_run(cluster: Cluster, services: Any) -> None:
    worker = cluster.start_worker()
    cluster.start_beat(DTASK_SCHEDULE_SECONDS=SCHEDULE_SECONDS)
    await cluster.wait_worker_ready(worker)
    schedule = await add(services, "tick")

    async def three_done() -> list[dict[str, Any]] | None:
        done = [t for t in await tasks_by_slot(services, {"from": "tick"}) if t["status"] == "success"]
        return done if len(done) >= 3 else None

    done = await wait_for(
        three_done, within=STARTUP_TIMEOUT, interval=0.2, what="three scheduled tasks to run"
    )
    for task in done:
        assert task["owner"] == "alice" and task["result"] == {"from": "tick"}
        assert task["started_at"] >= task["run_at"]
        steps = (task["run_at"] - schedule["next_run_at"]) / timedelta(seconds=EVERY)
        assert steps == int(steps), task["run_at"]  # on the grid
    lags = [
        ((t["created_at"] - t["run_at"]).total_seconds(), (t["started_at"] - t["run_at"]).total_seconds())
        for t in done
    ]
    print("created / started after the slot (s): " + ", ".join(f"{c:.2f} / {s:.2f}" for c, s in lags))
    got = (await ScheduleStore.of(services).find("tick", "alice"))[0]
    assert got["last_error"] is None and got["next_run_at"] > done[-1]["run_at"]


async def test_two_beats_one_restarted_mid_run_make_one_task_per_slot(
    cluster: Cluster, services: Any
) -> None:
    worker = cluster.start_worker()
    first = cluster.start_beat("beat-a", DTASK_SCHEDULE_SECONDS=SCHEDULE_SECONDS)
    cluster.start_beat("beat-b", DTASK_SCHEDULE_SECONDS=SCHEDULE_SECONDS)
    await cluster.wait_worker_ready(worker)
    schedule = await add(services, "both")

    async def slots(n: int) -> list[dict[str, Any]] | None:
        found = await tasks_by_slot(services, {"from": "both"})
        return found if len(found) >= n else None

    await wait_for(lambda: slots(3), within=STARTUP_TIMEOUT, interval=0.2, what="three slots")
    first.killpg(signal.SIGKILL)  # mid-run: a restarted beat sends every entry again at once
    first.popen.wait(10)
    cluster.start_beat("beat-a2", DTASK_SCHEDULE_SECONDS=SCHEDULE_SECONDS)
    before = len(await tasks_by_slot(services, {"from": "both"}))
    await wait_for(lambda: slots(before + 3), within=STARTUP_TIMEOUT, interval=0.2, what="three more slots")
    await asyncio.sleep(EVERY)  # let the passes of the last slot all run

    tasks = await tasks_by_slot(services, {"from": "both"})
    instants = [t["run_at"] for t in tasks]
    assert len(instants) == len(set(instants)), instants  # one task per slot
    for at in instants:
        steps = (at - schedule["next_run_at"]) / timedelta(seconds=EVERY)
        assert steps == int(steps) and steps >= 0, at
    # Both beats really sent the duty, several times per slot.
    sent = {}
    for name in ("beat-a", "beat-b", "beat-a2"):
        sent[name] = next(p for p in cluster.procs if p.name == name).log_text().count("fire-schedules")
    print(f"{len(tasks)} slots, one task each; scheduler passes sent per beat: {sent}")
    assert sent["beat-b"] >= 2 and sent["beat-a2"] >= 2, sent
    runs = await services.engine.connect()
    try:
        count = (await runs.execute(text("SELECT count(*) FROM schedule_runs"))).scalar_one()
    finally:
        await runs.close()
    assert count == len(tasks)
