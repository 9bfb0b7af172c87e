"""How an attempt ends when its handler misbehaves or its terminal write fails:
cleanup keeps the lease, an unresponsive handler is cut loose, each failure says what it was.

Handlers run in this process's event loop, as in a worker child, against the real database.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from domains.diagnostics.tasks import SPECS as DIAGNOSTICS
from tasks_core.registry import Registry
from tasks_core.services import build_services
from tasks_core.submission import Submitter, TaskIntent
from tasks_core.worker.runtime import HandlerUnresponsive, run_task
from tests.conftest import make_settings
from tests.handlers_for_tests import EVENTS, RELEASE, TEST_SPECS

LEASE = 1.5


@pytest.fixture
async def svc(clean_db: None) -> Any:
    services = build_services(
        make_settings(lease_seconds=LEASE, shutdown_grace_seconds=0.3, cleanup_grace_seconds=1.0),
        registry=Registry([*DIAGNOSTICS, *TEST_SPECS]),
        pool_size=10,
    )
    EVENTS.clear()
    RELEASE.clear()
    yield services
    RELEASE.append(True)  # let a swallowing handler still in this loop finish
    await asyncio.sleep(0.1)
    await services.close()


async def submit(svc: Any, task_type: str, payload: dict[str, Any] | None = None) -> uuid.UUID:
    return (await Submitter(svc).submit(TaskIntent(task_type, payload or {}))).task_id


async def until_running(svc: Any, task_id: uuid.UUID) -> None:
    for _ in range(200):
        if (await svc.repo.get(task_id))["status"] == "running":
            return
        await asyncio.sleep(0.02)
    raise AssertionError("never ran")


async def test_a_cleanup_longer_than_the_lease_still_ends_cancelled(svc: Any) -> None:
    # Cleanup (2.5 s) outlasts the lease (1.5 s) but not the cleanup grace: the heartbeat keeps
    # beating until the terminal write, so the cancel is recorded instead of the lease lapsing.
    svc.settings.cleanup_grace_seconds = 10.0
    task_id = await submit(svc, "test.slow_cleanup", {"cleanup": LEASE + 1.0})
    runner = asyncio.create_task(run_task(svc, str(task_id)))
    await until_running(svc, task_id)
    assert await svc.repo.request_cancel(task_id, svc.registry) == "requested"
    outcome = await asyncio.wait_for(runner, 15)
    row = await svc.repo.get(task_id)
    assert ("cleaned", task_id) in EVENTS
    assert outcome.status == "cancelled" and row["status"] == "cancelled", row
    assert [a["outcome"] for a in await svc.repo.attempts(task_id)] == ["cancelled"]


async def test_a_handler_that_swallows_cancellation_is_cut_loose_after_the_grace(svc: Any) -> None:
    task_id = await submit(svc, "test.swallow_cancel")
    runner = asyncio.create_task(run_task(svc, str(task_id)))
    await until_running(svc, task_id)
    await svc.repo.request_cancel(task_id, svc.registry)
    with pytest.raises(HandlerUnresponsive):  # the worker recycles the process on this
        await asyncio.wait_for(runner, 15)
    row = await svc.repo.get(task_id)
    assert ("swallowed", task_id) in EVENTS
    assert row["status"] == "failed" and row["error"]["code"] == "handler_unresponsive", row
    assert row["attempt_token"] is None  # the slot is free for the next task


async def test_a_raising_hook_is_labelled_hook_failed_with_details_for_operators_only(svc: Any) -> None:
    task_id = await submit(svc, "test.broken_success_hook")
    outcome = await run_task(svc, str(task_id))
    row = await svc.repo.get(task_id)
    assert outcome.status == "failed" and row["error"]["code"] == "hook_failed"
    assert "db-internal-7" not in row["error"]["message"]  # owners see the class, not the text
    [attempt] = await svc.repo.attempts(task_id)
    assert attempt["outcome"] == "hook_failed" and "db-internal-7" in attempt["detail"]


async def test_a_handler_error_shows_its_class_and_first_line_and_keeps_the_traceback(svc: Any) -> None:
    task_id = await submit(svc, "diagnostics.fail", {"message": "first line\nsecond line"})
    await run_task(svc, str(task_id))
    row = await svc.repo.get(task_id)
    assert row["error"] == {"code": "handler_error", "message": "RuntimeError: first line"}
    [attempt] = await svc.repo.attempts(task_id)
    assert "second line" in attempt["detail"] and "Traceback" in attempt["detail"]


async def test_a_handler_module_slower_to_import_than_a_lease_keeps_the_lease(svc: Any) -> None:
    import sys

    from tasks_core.registry import TaskSpec

    sys.modules.pop("tests.slow_import_handler", None)
    registry = Registry([*DIAGNOSTICS, TaskSpec("test.slow_import", "tests.slow_import_handler:run")])
    svc.registry = registry
    task_id = (await Submitter(svc).submit(TaskIntent("test.slow_import"))).task_id
    outcome = await asyncio.wait_for(run_task(svc, str(task_id)), 30)
    row = await svc.repo.get(task_id)
    assert outcome.status == "success" and row["result"] == {"imported": True}, row
    assert row["attempt_count"] == 1
