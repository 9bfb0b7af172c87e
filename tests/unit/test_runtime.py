"""The worker runtime against a real database: claim, heartbeat, timeout, cancel, shutdown.

Handlers run in this process's event loop exactly as in a worker child; only Celery is absent.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from typing import Any

import pytest
from sqlalchemy import text

from domains.diagnostics.tasks import SPECS as DIAGNOSTICS
from tasks_core.registry import Registry, TaskSpec
from tasks_core.services import build_services
from tasks_core.store.outcomes import OwnershipLost
from tasks_core.submission import Submitter, TaskIntent
from tasks_core.worker.context import TaskContext
from tasks_core.worker.runtime import ShutdownSignal, run_task
from tests.conftest import make_settings
from tests.handlers_for_tests import EVENTS, TEST_SPECS


@pytest.fixture
async def svc(clean_db: None) -> Any:
    services = build_services(
        make_settings(lease_seconds=1.5, shutdown_grace_seconds=0.3),
        registry=Registry([*DIAGNOSTICS, *TEST_SPECS]),
        pool_size=10,
    )
    yield services
    await services.close()


async def submit(svc: Any, task_type: str, payload: dict[str, Any] | None = None, **kw: Any) -> uuid.UUID:
    result = await Submitter(svc).submit(TaskIntent(task_type, payload or {}, **kw))
    return result.task_id


async def wait_for(svc: Any, task_id: uuid.UUID, status: str, within: float = 10) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + within
    while True:
        row = await svc.repo.get(task_id)
        if row["status"] == status or asyncio.get_running_loop().time() > deadline:
            return row
        await asyncio.sleep(0.05)


async def diagnostics_run(svc: Any, task_id: uuid.UUID) -> Any:
    async with svc.engine.connect() as conn:
        return (
            await conn.execute(
                text("SELECT status, hook FROM diagnostics_runs WHERE task_id = :id"), {"id": task_id}
            )
        ).first()


async def test_progress_is_throttled_by_delta_but_every_new_message_is_persisted(svc: Any) -> None:
    task_id = await submit(svc, "diagnostics.noop")
    claim = await svc.repo.claim(task_id, svc.registry, capacity=4, lease_seconds=30)
    ctx = TaskContext(svc.repo, claim.task, claim.token, claim.attempt, progress_delta=5.0)

    writes = []
    original = svc.repo.report

    async def counting_report(*args: Any) -> bool:
        writes.append(args[2:])
        return await original(*args)

    svc.repo.report = counting_report
    for p in (1, 2, 3, 4):
        await ctx.report(p)
    assert writes == []  # below the 5-point delta: nothing written
    assert (await svc.repo.get(task_id))["progress"] == 0
    await ctx.report(5)
    await ctx.report(5.5, "parsing")  # same progress band, new message: message written
    await ctx.report(5.6, "parsing")  # nothing new
    await ctx.report(6, "indexing")
    row = await svc.repo.get(task_id)
    assert row["progress"] == 5 and row["message"] == "indexing"
    assert writes == [(5.0, None), (None, "parsing"), (None, "indexing")]
    await ctx.report(100)
    assert (await svc.repo.get(task_id))["progress"] == 100


async def test_report_after_losing_the_lease_raises_and_writes_nothing(svc: Any) -> None:
    task_id = await submit(svc, "diagnostics.noop")
    claim = await svc.repo.claim(task_id, svc.registry, capacity=4, lease_seconds=30)
    ctx = TaskContext(svc.repo, claim.task, claim.token, claim.attempt)
    async with svc.engine.begin() as conn:  # another attempt takes over
        await conn.execute(
            text("UPDATE tasks SET attempt_token = gen_random_uuid() WHERE id = :id"), {"id": task_id}
        )
    with pytest.raises(OwnershipLost):
        await ctx.report(50, "late")
    row = await svc.repo.get(task_id)
    assert row["progress"] == 0 and row["message"] is None


async def test_timeout_ends_failed_timeout_with_the_failure_hook(svc: Any) -> None:
    task_id = await submit(svc, "diagnostics.sleep", {"seconds": 30, "steps": 30}, timeout_seconds=0.5)
    outcome = await asyncio.wait_for(run_task(svc, str(task_id)), 10)
    row = await svc.repo.get(task_id)
    assert outcome.status == "failed"
    assert row["status"] == "failed" and row["error"]["code"] == "timeout"
    assert row["attempt_token"] is None and row["lease_expires_at"] is None
    assert tuple(await diagnostics_run(svc, task_id)) == ("failed", "failure:failed")


async def test_lost_heartbeat_cancels_the_handler_and_writes_nothing_more(svc: Any) -> None:
    EVENTS.clear()
    task_id = await submit(svc, "test.cleanup", {"seconds": 60})
    runner = asyncio.create_task(run_task(svc, str(task_id)))
    await wait_for(svc, task_id, "running")
    thief = uuid.uuid4()
    async with svc.engine.begin() as conn:
        await conn.execute(
            text("UPDATE tasks SET attempt_token = :t WHERE id = :id"), {"t": thief, "id": task_id}
        )
    stolen = await svc.repo.get(task_id)
    outcome = await asyncio.wait_for(runner, svc.settings.heartbeat_seconds * 3)
    assert outcome.status == "lost"
    assert ("cleanup", task_id) in EVENTS  # the handler was cancelled, its finally ran
    after = await svc.repo.get(task_id)
    assert after["status"] == "running" and after["attempt_token"] == thief  # the old owner wrote nothing
    assert after["lease_expires_at"] == stolen["lease_expires_at"]  # and renewed nothing


async def test_cancel_intent_stops_a_running_handler_within_a_heartbeat(svc: Any) -> None:
    EVENTS.clear()
    task_id = await submit(svc, "test.cleanup", {"seconds": 60})
    runner = asyncio.create_task(run_task(svc, str(task_id)))
    await wait_for(svc, task_id, "running")
    assert await svc.repo.request_cancel(task_id, svc.registry) == "requested"
    outcome = await asyncio.wait_for(runner, svc.settings.heartbeat_seconds * 2 + 1)
    row = await svc.repo.get(task_id)
    assert outcome.status == "cancelled" and row["status"] == "cancelled"
    assert ("cleanup", task_id) in EVENTS
    assert tuple(await diagnostics_run(svc, task_id)) == ("cancelled", "failure:cancelled")


async def test_duplicate_delivery_cannot_run_without_a_claim(svc: Any) -> None:
    task_id = await submit(svc, "diagnostics.sleep", {"seconds": 0.5})
    first, second = await asyncio.gather(run_task(svc, str(task_id)), run_task(svc, str(task_id)))
    assert sorted([first.claimed, second.claimed]) == [False, True]
    refused = first if not first.claimed else second
    assert refused.status in ("not_pending:running", "not_pending:success")
    again = await run_task(svc, str(task_id))
    assert (again.claimed, again.status) == (False, "not_pending:success")
    assert len(await svc.repo.attempts(task_id)) == 1


# A well-formed id of no task (fixed, so every pytest -n worker collects the same test ids).
@pytest.mark.parametrize("message", [None, 42, "not-a-uuid", ["x"], {"id": 1}, str(uuid.UUID(int=3))])
async def test_malformed_or_unknown_messages_are_dropped(svc: Any, message: Any) -> None:
    outcome = await run_task(svc, message)
    assert not outcome.claimed
    assert outcome.status in ("malformed_message", "unknown_task")
    assert (await svc.repo.summary())["total"] == 0


async def test_worker_shutdown_fails_a_plain_task_and_releases_a_retry_safe_one(svc: Any) -> None:
    plain = await submit(svc, "test.cleanup", {"seconds": 60})
    safe = await submit(svc, "test.retry_safe", {"seconds": 60})
    shutdown = ShutdownSignal()
    runs = [asyncio.create_task(run_task(svc, str(t), shutdown)) for t in (plain, safe)]
    await wait_for(svc, plain, "running")
    await wait_for(svc, safe, "running")
    shutdown.set()
    outcomes = await asyncio.wait_for(asyncio.gather(*runs), 5)
    assert [o.status for o in outcomes] == ["failed", "pending"]
    assert (await svc.repo.get(plain))["error"]["code"] == "worker_shutdown"
    released = await svc.repo.get(safe)
    assert released["status"] == "pending" and released["attempt_token"] is None
    assert [a["outcome"] for a in await svc.repo.attempts(safe)] == ["worker_shutdown"]


async def test_unserializable_result_fails_the_task_instead_of_losing_it(svc: Any) -> None:
    task_id = await submit(svc, "test.unserializable")
    outcome = await run_task(svc, str(task_id))
    row = await svc.repo.get(task_id)
    assert outcome.status == "failed" and row["error"]["code"] == "bad_result"


async def test_handler_is_rebuilt_from_the_registry_by_type_and_version(svc: Any) -> None:
    sys.modules.pop("tests.lazy_handler_module", None)
    registry = Registry([TaskSpec("lazy.type", "tests.lazy_handler_module:run", version=3)])
    assert "tests.lazy_handler_module" not in sys.modules  # registering imports nothing
    assert registry.runnable("lazy.type", 3) is not None
    assert registry.runnable("lazy.type", 2) is None and registry.runnable("other", 3) is None
    spec = registry.get("lazy.type")
    assert spec is not None
    with pytest.raises(ModuleNotFoundError):
        registry.handler(spec)  # imported only when a task of the type runs

    # A task stored at version 1 is not runnable by a deployment that now runs version 2.
    task_id = await submit(svc, "diagnostics.noop")
    bumped = Registry([TaskSpec("diagnostics.noop", "domains.diagnostics.handlers:noop", version=2)])
    svc.registry = bumped
    assert (await run_task(svc, str(task_id))).status == "not_runnable"
    svc.registry = Registry(DIAGNOSTICS)
    assert (await run_task(svc, str(task_id))).status == "success"


def test_legacy_rows_use_the_current_failure_hook_and_unknown_versions_none() -> None:
    registry = Registry(DIAGNOSTICS)
    assert registry.hook_for("diagnostics.sleep", 0, "failure") is not None
    assert registry.hook_for("diagnostics.sleep", 0, "success") is None
    assert registry.hook_for("diagnostics.sleep", 7, "failure") is None
    assert registry.hook_for("nope", 1, "failure") is None


async def test_a_message_arriving_during_shutdown_is_left_for_another_worker(svc: Any) -> None:
    task_id = await submit(svc, "diagnostics.noop")
    shutdown = ShutdownSignal()
    shutdown.set()
    outcome = await run_task(svc, str(task_id), shutdown)
    row = await svc.repo.get(task_id)
    assert (outcome.claimed, outcome.status) == (False, "worker_shutting_down")
    assert row["status"] == "pending" and row["last_published_at"] is None  # due for re-sending
    assert await svc.repo.attempts(task_id) == []


async def test_a_handler_that_ends_before_its_first_beat_starts_no_heartbeat_or_watch_task(svc: Any) -> None:
    """The heartbeat task starts at the first beat's time and the shutdown grace on the signal:
    a short attempt creates its handler task and nothing else that waits (each would cost CPU
    on every one of thousands of short attempts)."""
    quick = await submit(svc, "diagnostics.noop")
    slow = await submit(svc, "diagnostics.sleep", {"seconds": 1.2})  # past a beat (lease 1.5 s / 3)
    loop = asyncio.get_running_loop()
    started: list[str] = []  # the coroutine of every task created, by qualified name
    default = loop.get_task_factory()

    def recording(loop: Any, coro: Any, **kw: Any) -> Any:
        started.append(getattr(coro, "__qualname__", repr(coro)))
        return asyncio.Task(coro, loop=loop, **kw) if default is None else default(loop, coro, **kw)

    def attempt_tasks(names: list[str]) -> list[str]:
        return [n for n in names if n.startswith(("Execution.", "Event."))]

    loop.set_task_factory(recording)
    try:
        assert (await run_task(svc, str(quick), ShutdownSignal())).status == "success"
        quick_tasks = attempt_tasks(started)
        started.clear()
        assert (await run_task(svc, str(slow), ShutdownSignal())).status == "success"
    finally:
        loop.set_task_factory(default)
    assert quick_tasks == ["Execution._load_and_run"]
    assert attempt_tasks(started) == ["Execution._load_and_run", "Execution._heartbeat"]
    row = await svc.repo.get(slow)
    assert row["heartbeat_at"] > row["started_at"]  # the slow one beat, through the same code
