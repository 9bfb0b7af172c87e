"""The reconciler's legacy duty: tasks the pre-durable release left pending or running (version 0)
converge through the current type's failure hook, whatever their lease says; unknown types fail
closed without a hook; `legacy_backlog` (shown by `dtask db-status`) counts what is left."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from repo_helpers import db_now, insert_raw, run_row, task_row

from tasks_core.duties import reconciler


async def test_legacy_tasks_converge_through_the_failure_hook_and_unknown_types_fail_closed(
    services: Any,
) -> None:
    engine, repo = services.engine, services.repo
    now = await db_now(engine)
    # As the upgrade leaves them: a placeholder owner whose lease is over (here even a live one).
    running = await insert_raw(
        engine, version=0, status="running", lease_expires_at=now + timedelta(hours=1), run_row=True
    )
    pending_cancel = await insert_raw(engine, version=0, cancel_requested_at=now, run_row=True)
    unknown = await insert_raw(
        engine, task_type="reports.render", version=0, status="running", lease_expires_at=now, run_row=True
    )
    unknown_cancel = await insert_raw(
        engine, task_type="reports.render", version=0, cancel_requested_at=now, run_row=True
    )
    finished = await insert_raw(engine, version=0, status="success", finished_at=now)
    assert await repo.legacy_backlog() == {"pending": 2, "running": 2}

    report = await reconciler.reconcile(services)

    assert (report.legacy, report.hook_errors, report.errors) == (4, 0, [])
    expected = {
        running: ("failed", "legacy_interrupted", ("failed", "failure:failed")),
        pending_cancel: ("cancelled", "cancelled", ("cancelled", "failure:cancelled")),
        unknown: ("failed", "handler_unavailable", ("running", None)),  # no hook ran
        unknown_cancel: ("cancelled", "handler_unavailable", ("running", None)),
    }
    for task_id, (status, code, run) in expected.items():
        row = await task_row(engine, task_id)
        assert (row["status"], row["error"]["code"]) == (status, code)
        assert row["attempt_token"] is None and row["finished_at"] is not None
        got = await run_row(engine, task_id)
        assert got is not None and (got["status"], got["hook"]) == run
    assert (await task_row(engine, finished))["status"] == "success"
    assert await repo.legacy_backlog() == {}
    again = await reconciler.reconcile(services)
    assert again.legacy == 0
