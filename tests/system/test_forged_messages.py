"""Forged broker messages against a real worker through the real Redis.

Anyone who can write to the broker can send any message. None of these may run anything but our
own tasks, delete history younger than the retention, or cost more than a line of log.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import text

from tasks_core.submission import Submitter, TaskIntent
from tests.system.conftest import Cluster, wait_for

pytestmark = pytest.mark.system

FORGED_ID_CHARS = 20_000_000


async def test_forged_messages_run_nothing_delete_nothing_and_log_a_line(
    cluster: Cluster, services: Any
) -> None:
    from tasks_core.celery_app import app
    from tasks_core.transport import DURABLE_QUEUE, DUTIES_QUEUE

    worker = cluster.start_worker(concurrency=2)
    await cluster.wait_worker_ready(worker)
    # History: a task that finished two hours ago (well inside the one-day retention floor).
    old = (await Submitter(services).submit(TaskIntent("diagnostics.noop"))).task_id
    async with services.engine.begin() as conn:
        await conn.execute(
            text(
                """UPDATE tasks SET status = 'success', finished_at = clock_timestamp() - interval '2 hours'
                WHERE id = :id"""
            ),
            {"id": old},
        )

    def forge() -> None:
        app.send_task("dtask.prune", args=[1e-9], queue=DUTIES_QUEUE)
        app.send_task("celery.accumulate", args=[1, 2], queue=DURABLE_QUEUE)
        app.send_task("dtask.run", args=[12345], queue=DURABLE_QUEUE)
        app.send_task("dtask.run", args=["x" * FORGED_ID_CHARS], queue=DURABLE_QUEUE)
        app.send_task("dtask.run", args=[str(old)], serializer="pickle", queue=DURABLE_QUEUE)

    await asyncio.to_thread(forge)

    expected = (
        "Task dtask.prune[",  # ran, with the retention floor
        "Received unregistered task of type 'celery.accumulate'",
        "dropping malformed task message 12345",
        "dropping malformed task message 'xxxx",
        "untrusted content of type pickle",
    )

    async def all_seen() -> bool:
        log = worker.log_text()
        return all(marker in log for marker in expected)

    await wait_for(all_seen, within=30, what="the worker to handle every forged message")
    assert await services.repo.get(old) is not None, "a forged prune deleted history"
    log = worker.log_text()
    assert "x" * 5000 not in log, "the forged 20 MB id was logged whole"
    assert max(len(line) for line in log.splitlines()) < 20_000
    # The worker is unharmed: a real task still runs.
    fresh = (await Submitter(services).submit(TaskIntent("diagnostics.noop", {"ok": 1}))).task_id

    async def done() -> dict[str, Any] | None:
        row = await services.repo.get(fresh)
        return row if row and row["status"] == "success" else None

    assert (await wait_for(done, within=30, what="a real task after the forgeries"))["result"] == {"ok": 1}
    assert (await services.repo.get(old))["attempt_count"] == 0  # the pickled run never claimed it


def test_only_our_tasks_are_registered() -> None:
    from tasks_core.celery_app import OUR_TASKS, app

    app.finalize(auto=True)
    assert set(app.tasks) == OUR_TASKS


def test_a_long_record_is_truncated_by_the_log_filter() -> None:
    import logging

    from tasks_core.logs import Truncate

    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "body %s", ("y" * 100_000,), None)
    assert Truncate(1000).filter(record)
    assert len(record.getMessage()) < 1100 and record.getMessage().endswith("more characters]")


async def test_five_forged_runs_of_a_running_task_are_all_refused(cluster: Cluster, services: Any) -> None:
    from tasks_core.transport import CeleryTransport

    worker = cluster.start_worker(concurrency=4)
    await cluster.wait_worker_ready(worker)
    task_id = (
        await Submitter(services).submit(TaskIntent("diagnostics.sleep", {"seconds": 3, "steps": 3}))
    ).task_id

    async def running() -> bool:
        row = await services.repo.get(task_id)
        return row is not None and row["status"] == "running"

    await wait_for(running, within=30, what="the task to run")
    await asyncio.to_thread(CeleryTransport().publish_sync, [str(task_id)] * 5)

    async def refused() -> bool:
        return worker.log_text().count("not claimed: not_pending:running") >= 5

    await wait_for(refused, within=30, what="five refusals")

    async def done() -> dict[str, Any] | None:
        row = await services.repo.get(task_id)
        return row if row and row["status"] == "success" else None

    row = await wait_for(done, within=30, what="the task to finish")
    assert row["attempt_count"] == 1 and len(await services.repo.attempts(task_id)) == 1
