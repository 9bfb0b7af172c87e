"""Run later, run first, retry and pause with a real worker and beat: a delayed task starts once
due (sent by the publisher, no broker countdown), a freed slot goes to the highest priority, a
transient failure is retried with each attempt's error kept, a failed task is retried by hand
once, and a paused type's task waits for its resume."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from sqlalchemy import text

from tasks_core.retries import Retried, RetryRefused, retry_tasks
from tasks_core.submission import Submitter, TaskIntent
from tests.system.conftest import PUBLISH_SECONDS, STARTUP_TIMEOUT, Cluster, wait_for
from tests.system.test_worker_processes import MARGIN, attempts, diagnostics_run, get, wait_terminal

FAST_RETRIES = {"DTASK_RETRY_BACKOFF_SECONDS": "0.2", "DTASK_RETRY_BACKOFF_MAX_SECONDS": "0.5"}


async def test_a_delayed_task_is_not_running_before_its_instant_and_starts_once_due(
    cluster: Cluster, services: Any
) -> None:
    worker = cluster.start_worker()
    cluster.start_beat()
    await cluster.wait_worker_ready(worker)
    await cluster.wait_readiness_fact()  # beat's duties run: the publisher is there when it is due
    submitted = time.monotonic()
    later = await Submitter(services).submit(TaskIntent("diagnostics.noop", {"n": 1}, delay_seconds=3))
    assert not later.published  # nothing on the broker: the publisher sends it when due
    await asyncio.sleep(max(0.0, 2.5 - (time.monotonic() - submitted)))
    row = await get(services, later.task_id)
    assert row["status"] == "pending" and row["started_at"] is None, row  # at 2.5 s: still waiting

    async def started() -> dict[str, Any] | None:
        got = await get(services, later.task_id)
        return got if got["started_at"] is not None else None

    left = 3 + PUBLISH_SECONDS + MARGIN - (time.monotonic() - submitted)
    await wait_for(started, within=left, interval=0.1, what="the delayed task to start")
    row = await wait_terminal(services, later.task_id, within=30)
    assert row["status"] == "success", row
    lag = (row["started_at"] - row["run_at"]).total_seconds()
    print(f"started {lag:.2f} s after its instant (publish interval {PUBLISH_SECONDS} s)")
    assert row["started_at"] >= row["run_at"], row


async def test_a_priority_task_submitted_last_runs_next(cluster: Cluster, services: Any) -> None:
    """Capacity 1: a sleeper holds the slot while ten priority-0 tasks and then one priority-10
    task queue behind it; the terminal write's relay hands the slot to the priority-10 one."""
    worker = cluster.start_worker(DTASK_CAPACITY="1", DTASK_PUBLISH_SECONDS="3600", DTASK_PUBLISH_AHEAD="0")
    await cluster.wait_worker_ready(worker)
    services.settings.capacity, services.settings.publish_ahead = 1, 0
    submit = Submitter(services).submit
    sleeper = await submit(TaskIntent("diagnostics.sleep", {"seconds": 2, "steps": 2}))
    plain = [(await submit(TaskIntent("diagnostics.noop", {"n": i}))).task_id for i in range(10)]
    urgent = (await submit(TaskIntent("diagnostics.noop", {"urgent": True}, priority=10))).task_id
    await wait_terminal(services, sleeper.task_id, within=STARTUP_TIMEOUT)
    rows = {t: await wait_terminal(services, t, within=60) for t in [urgent, *plain]}
    assert all(r["status"] == "success" for r in rows.values()), rows
    order = sorted(rows, key=lambda t: rows[t]["started_at"])
    assert order == [urgent, *plain], [(str(t), rows[t]["started_at"]) for t in order]  # then by age


async def test_flaky_succeeds_on_attempt_three_and_runs_out_after_five_with_one_hook(
    cluster: Cluster, services: Any
) -> None:
    worker = cluster.start_worker(**FAST_RETRIES)
    cluster.start_beat(**FAST_RETRIES)
    await cluster.wait_worker_ready(worker)
    submit = Submitter(services).submit
    twice = (await submit(TaskIntent("diagnostics.flaky", {"fail_times": 2}))).task_id
    never = (await submit(TaskIntent("diagnostics.flaky", {"fail_times": 9}))).task_id
    done = await wait_terminal(services, twice, within=30)
    assert (done["status"], done["attempt_count"], done["result"]) == ("success", 3, {"attempt": 3}), done
    trail = await attempts(services, twice)
    assert [a["outcome"] for a in trail] == ["retry", "retry", "success"], trail
    assert "attempt 1 fails on purpose" in trail[0]["detail"] and "attempt 2 fails" in trail[1]["detail"]

    failed = await wait_terminal(services, never, within=30)
    assert (failed["status"], failed["attempt_count"], failed["error"]["code"]) == ("failed", 5, "flaky"), (
        failed
    )
    trail = await attempts(services, never)
    assert [a["outcome"] for a in trail] == ["retry"] * 4 + ["flaky"], trail
    # The failure hook ran at the last failure only: an earlier run would have frozen the row then.
    run = await diagnostics_run(services, never)
    assert run is not None and run["hook"] == "failure:failed", run
    assert run["updated_at"] >= trail[-1]["claimed_at"], (run, trail[-1])


async def test_a_failed_task_is_retried_by_hand_once_and_a_running_one_is_refused(
    cluster: Cluster, services: Any
) -> None:
    worker = cluster.start_worker()
    await cluster.wait_worker_ready(worker)
    submitter = Submitter(services)
    failed = (await submitter.submit(TaskIntent("diagnostics.fail", {}), owner="ops")).task_id
    running = (await submitter.submit(TaskIntent("diagnostics.sleep", {"seconds": 20, "steps": 20}),
                                      owner="ops")).task_id  # fmt: skip
    assert (await wait_terminal(services, failed, within=STARTUP_TIMEOUT))["status"] == "failed"
    [retried, refused] = await retry_tasks(submitter, [failed, running], owner="ops", admin=True)
    assert isinstance(refused, RetryRefused) and refused.status == 409, refused
    assert isinstance(retried, Retried)
    new = await wait_terminal(services, retried.new.task_id, within=30)  # diagnostics.fail fails again
    assert new["status"] == "failed" and new["retry_of"] == failed, new
    assert (await get(services, failed))["retried_by"] == retried.new.task_id
    async with services.engine.connect() as conn:
        copies = (
            await conn.execute(text("SELECT count(*) FROM tasks WHERE retry_of = :id"), {"id": failed})
        ).scalar()
    assert copies == 1
    await services.repo.request_cancel(running, services.registry)


async def test_a_paused_types_task_waits_then_runs_after_resume(cluster: Cluster, services: Any) -> None:
    worker = cluster.start_worker()
    cluster.start_beat()
    await cluster.wait_worker_ready(worker)
    await services.repo.pause_type("diagnostics.noop", by="ops")
    held = (await Submitter(services).submit(TaskIntent("diagnostics.noop", {"held": True}))).task_id
    other = (await Submitter(services).submit(TaskIntent("diagnostics.sleep", {"seconds": 0}))).task_id
    assert (await wait_terminal(services, other, within=30))["status"] == "success"  # others go on
    await asyncio.sleep(PUBLISH_SECONDS + 1)  # a publish pass and more: still not sent, not claimed
    row = await get(services, held)
    assert (row["status"], row["attempt_count"]) == ("pending", 0), row
    assert await services.repo.waiting_reason(row, 4) == "type paused"

    from tasks_core.duties.relay import relay

    assert await services.repo.resume_type("diagnostics.noop")
    await relay(services, by="resume")
    assert (await wait_terminal(services, held, within=30))["status"] == "success"
