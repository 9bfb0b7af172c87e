"""The dense mode (`dtask worker --pool threads`): many durable tasks in one worker process, on one
event loop, with the same ownership rules as a process per task. Real worker and beat processes."""

from __future__ import annotations

import asyncio
import signal
import uuid
from typing import Any

import pytest

from tasks_core.store.outcomes import NewTask
from tasks_core.submission import Submitter, TaskIntent
from tasks_core.transport import CeleryTransport
from tests.system.conftest import Cluster, wait_for

pytestmark = pytest.mark.system
SLEEP = {"seconds": 30, "steps": 60}
DENSE = {"DTASK_CAPACITY": "8", "DTASK_EXTRA_TASK_MODULES": "tests.system.specs"}


async def submit_all(services: Any, n: int, payload: dict[str, Any] = SLEEP) -> list[uuid.UUID]:
    results = await Submitter(services).submit_many([TaskIntent("diagnostics.sleep", payload)] * n)
    return [r.task_id for r in results if not isinstance(r, Exception)]


async def statuses(services: Any, ids: list[uuid.UUID]) -> list[str]:
    return [(await services.repo.get(i))["status"] for i in ids]


async def all_running(services: Any, ids: list[uuid.UUID]) -> None:
    async def running() -> bool:
        return await statuses(services, ids) == ["running"] * len(ids)

    await wait_for(running, within=45, what=f"{len(ids)} tasks to run")


async def owners(services: Any, ids: list[uuid.UUID]) -> set[str]:
    return {(await services.repo.attempts(i))[-1]["worker"] for i in ids}


async def test_several_tasks_share_one_process_and_a_sigkill_fails_them_all_through_the_reconciler(
    cluster: Cluster, services: Any
) -> None:
    dense = cluster.start_worker("dense", concurrency=20, pool="threads", **DENSE)
    cluster.start_beat(DTASK_CAPACITY="8")
    await cluster.wait_worker_ready(dense)
    ids = await submit_all(services, 6)
    await all_running(services, ids)
    assert len(await owners(services, ids)) == 1  # all six in one process, on one event loop
    # Another worker, to recover them (the dense one runs the duties too, until it dies).
    rescuer = cluster.start_worker("rescuer", concurrency=3, DTASK_CAPACITY="8")
    await cluster.wait_worker_ready(rescuer)
    dense.killpg(signal.SIGKILL)

    async def converged() -> bool:
        return all(s in ("failed", "success") for s in await statuses(services, ids))

    await wait_for(converged, within=30, what="the killed process's tasks to converge")
    for task_id in ids:
        row = await services.repo.get(task_id)
        assert row["status"] == "failed" and row["error"]["code"] == "lease_expired", row
        assert len(await services.repo.attempts(task_id)) == 1


async def test_cancelling_one_task_leaves_its_neighbours_running(cluster: Cluster, services: Any) -> None:
    dense = cluster.start_worker("dense", concurrency=20, pool="threads", **DENSE)
    await cluster.wait_worker_ready(dense)
    ids = await submit_all(services, 4)
    await all_running(services, ids)
    assert len(await owners(services, ids)) == 1  # all four in one process
    assert await services.repo.request_cancel(ids[0], services.registry) == "requested"

    async def cancelled() -> bool:
        return (await statuses(services, ids[:1])) == ["cancelled"]

    await wait_for(cancelled, within=15, what="the cancel")
    assert await statuses(services, ids[1:]) == ["running"] * 3
    for task_id in ids[1:]:
        assert await services.repo.request_cancel(task_id, services.registry) == "requested"


async def test_a_handler_blocking_the_loop_is_named_and_its_neighbours_keep_their_leases(
    cluster: Cluster, services: Any
) -> None:
    # Lease 6 s: a 2 s block delays the neighbours' heartbeats (every 2 s) but cannot cost a lease.
    dense = cluster.start_worker("dense", concurrency=20, pool="threads", DTASK_LEASE_SECONDS="6", **DENSE)
    await cluster.wait_worker_ready(dense)
    neighbours = await submit_all(services, 3, {"seconds": 12, "steps": 24})
    await all_running(services, neighbours)
    async with services.engine.begin() as conn:
        blocker = (
            await services.repo.insert(
                conn, NewTask("system.block_loop", 1, {"seconds": 2}, timeout_seconds=60)
            )
        ).id
    await asyncio.to_thread(CeleryTransport().publish_sync, [str(blocker)])

    async def warned() -> bool:
        return f"the handler of system.block_loop (task {blocker})" in dense.log_text()

    await wait_for(warned, within=30, what="the loop-lag warning naming the blocking handler")

    async def done() -> bool:
        return all(s in ("success", "failed") for s in await statuses(services, [*neighbours, blocker]))

    await wait_for(done, within=45, what="every task to end")
    rows = [await services.repo.get(i) for i in neighbours]
    assert all(r["status"] == "success" and r["attempt_count"] == 1 for r in rows), rows
    assert (await services.repo.get(blocker))["status"] == "success"
    assert "event loop turning again after" in dense.log_text()
