"""Run later and run first with a real worker and beat: a delayed task starts from its instant on,
sent by the publisher (no broker countdown), and a freed slot goes to the highest priority."""

from __future__ import annotations

import uuid
from typing import Any

from tasks_core.submission import Submitter, TaskIntent
from tests.system.conftest import PUBLISH_SECONDS, STARTUP_TIMEOUT, Cluster
from tests.system.test_worker_processes import MARGIN, TERMINAL, get, wait_terminal


async def test_a_delayed_task_starts_once_due_and_not_before(cluster: Cluster, services: Any) -> None:
    worker = cluster.start_worker()
    cluster.start_beat()
    await cluster.wait_worker_ready(worker)
    later = await Submitter(services).submit(TaskIntent("diagnostics.noop", {"n": 1}, delay_seconds=4))
    assert not later.published  # nothing on the broker: the publisher sends it when due
    row = await wait_terminal(services, later.task_id, within=4 + PUBLISH_SECONDS + MARGIN)
    assert row["status"] == "success", row
    lag = (row["started_at"] - row["run_at"]).total_seconds()
    print(f"started {lag:.2f} s after its instant (publish interval {PUBLISH_SECONDS} s)")
    assert row["started_at"] >= row["run_at"] and row["attempt_count"] == 1, row


async def test_a_freed_slot_goes_to_the_highest_priority_first(cluster: Cluster, services: Any) -> None:
    """Capacity 1: a sleeper holds the slot while low, then high priority tasks queue behind it;
    the terminal write's relay hands the slot to the high one first."""
    worker = cluster.start_worker(DTASK_CAPACITY="1", DTASK_PUBLISH_SECONDS="3600", DTASK_PUBLISH_AHEAD="0")
    await cluster.wait_worker_ready(worker)
    services.settings.capacity, services.settings.publish_ahead = 1, 0
    submit = Submitter(services).submit
    sleeper = await submit(TaskIntent("diagnostics.sleep", {"seconds": 2, "steps": 2}))
    queued: list[tuple[int, uuid.UUID]] = []
    for priority in (-5, 0, 0, 50):
        queued.append(
            (priority, (await submit(TaskIntent("diagnostics.noop", {}, priority=priority))).task_id)
        )
    await wait_terminal(services, sleeper.task_id, within=STARTUP_TIMEOUT)
    rows = [await wait_terminal(services, task_id, within=30) for _, task_id in queued]
    assert all(r["status"] in TERMINAL and r["status"] == "success" for r in rows), rows
    started = sorted(zip(rows, (p for p, _ in queued), strict=True), key=lambda rp: rp[0]["started_at"])
    assert [p for _, p in started] == [50, 0, 0, -5], [(p, r["started_at"]) for r, p in started]
    # Equal priorities keep their age order.
    zeros = [r["id"] for r, p in started if p == 0]
    assert zeros == [queued[1][1], queued[2][1]]
    assert (await get(services, sleeper.task_id))["status"] == "success"
