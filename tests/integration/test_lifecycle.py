"""Cancel, delete and prune: what a user or operator does to a task from outside."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from repo_helpers import (
    at,
    attempt_rows,
    claim,
    db_now,
    run_row,
    running_task,
    scalar,
    submit,
    task_row,
)

from tasks_core.model import Status


async def test_cancelling_a_pending_task_is_terminal_at_once_with_its_hook(services: Any) -> None:
    """Protocol 11, I6: a pending task is cancelled immediately in one transaction: status,
    finished_at, cancel intent, error, its failure hook's domain row, and the dedupe key released."""
    repo, reg, engine = services.repo, services.registry, services.engine
    task_id = await submit(repo, dedupe_key="k-pending")

    assert await repo.request_cancel(task_id, reg) == "cancelled"

    row = await task_row(engine, task_id)
    assert row["status"] == "cancelled"
    assert row["finished_at"] is not None and row["cancel_requested_at"] is not None
    assert row["error"]["code"] == "cancelled"
    assert row["attempt_token"] is None and row["attempt_count"] == 0
    assert await attempt_rows(engine, task_id) == []
    run = await run_row(engine, task_id)
    assert run is not None and (run["status"], run["hook"]) == ("cancelled", "failure:cancelled")
    # A claim that arrives afterwards (a message already in flight) finds nothing to run.
    assert await repo.claim(task_id, reg, capacity=4, lease_seconds=30) == "not_pending:cancelled"
    assert await submit(repo, dedupe_key="k-pending") != task_id


async def test_cancelling_a_terminal_task_changes_nothing(services: Any) -> None:
    repo, reg, engine = services.repo, services.registry, services.engine
    task_id, got = await running_task(repo, reg)
    await repo.finish(task_id, got.token, reg, status=Status.SUCCESS, result={"r": 1})
    before = await task_row(engine, task_id)

    assert await repo.request_cancel(task_id, reg) == "terminal"

    assert await task_row(engine, task_id) == before
    assert before["cancel_requested_at"] is None
    assert (await run_row(engine, task_id))["status"] == "done"  # type: ignore[index]


async def test_cancelling_an_unknown_task_answers_none(services: Any) -> None:
    assert await services.repo.request_cancel(uuid.uuid4(), services.registry) is None


async def test_delete_removes_only_terminal_tasks(services: Any) -> None:
    repo, reg, engine = services.repo, services.registry, services.engine
    pending = await submit(repo)
    running, _ = await running_task(repo, reg)
    done, got = await running_task(repo, reg)
    await repo.finish(
        done, got.token, reg, status=Status.FAILED, error={"code": "handler_error", "message": "x"}
    )

    assert await repo.delete(pending) == "active"
    assert await repo.delete(running) == "active"
    assert await repo.delete(uuid.uuid4()) is None
    assert await repo.delete(done) == "deleted"
    assert await repo.delete(done) is None

    remaining = await scalar(engine, "SELECT array_agg(id ORDER BY id) FROM tasks")
    assert sorted(remaining) == sorted([pending, running])
    # Its attempts and domain rows go with it; the others keep theirs.
    assert await scalar(engine, "SELECT count(*) FROM task_attempts WHERE task_id = :id", id=done) == 0
    assert await run_row(engine, done) is None
    assert len(await attempt_rows(engine, running)) == 1


async def test_prune_deletes_terminal_tasks_by_age_only(services: Any) -> None:
    """Prune keeps anything active however old, and terminal tasks younger than the cut-off; the
    age is judged by the database clock (pinned here), in bounded batches."""
    repo, reg, engine = services.repo, services.registry, services.engine
    now = await db_now(engine)
    three_hours_ago = at(engine, now - timedelta(hours=3))

    old_cancelled = [await submit(three_hours_ago) for _ in range(3)]
    for task_id in old_cancelled:
        assert await three_hours_ago.request_cancel(task_id, reg) == "cancelled"
    old_done = await submit(three_hours_ago)
    got = await claim(three_hours_ago, reg, old_done, lease=60)
    await three_hours_ago.finish(old_done, got.token, reg, status=Status.SUCCESS, result={})
    old_pending = await submit(three_hours_ago)
    old_running = await submit(three_hours_ago)
    await claim(three_hours_ago, reg, old_running, lease=24 * 3600)
    recent = await submit(repo)
    assert await repo.request_cancel(recent, reg) == "cancelled"

    assert await repo.prune(older_than_seconds=4 * 3600) == 0
    assert await repo.prune(older_than_seconds=3600, batch=2) == 4  # 2 + 2 + a final empty batch

    left = set(await scalar(engine, "SELECT array_agg(id) FROM tasks"))
    assert left == {old_pending, old_running, recent}
    # From two hours in the future the recent one is old enough too; active rows still stay.
    assert await at(engine, now + timedelta(hours=2)).prune(older_than_seconds=3600) == 1
    assert set(await scalar(engine, "SELECT array_agg(id) FROM tasks")) == {old_pending, old_running}


async def test_a_success_turned_cancelled_runs_the_failure_hook_even_for_a_type_without_a_success_hook(
    services: Any,
) -> None:
    """Cancel intent beats a concurrent success; the hook that runs is the final status's."""
    from domains.diagnostics.tasks import SPECS as DIAGNOSTICS
    from tasks_core.registry import Registry
    from tests.handlers_for_tests import TEST_SPECS
    from tests.integration.repo_helpers import run_row, submit

    registry = Registry([*DIAGNOSTICS, *TEST_SPECS])  # test.cleanup: a failure hook only
    repo = services.repo
    task_id = await submit(repo, "test.cleanup")
    claim = await repo.claim(task_id, registry, capacity=4, lease_seconds=30)
    assert await repo.request_cancel(task_id, registry) == "requested"
    final = await repo.finish(task_id, claim.token, registry, status=Status.SUCCESS, result={"done": True})
    assert final == Status.CANCELLED
    row = await repo.get(task_id)
    assert row["status"] == "cancelled" and row["result"] is None and row["error"]["code"] == "cancelled"
    run = await run_row(services.engine, task_id)
    assert run is not None and (run["status"], run["hook"]) == ("cancelled", "failure:cancelled"), run
