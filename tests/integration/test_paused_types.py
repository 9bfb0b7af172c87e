"""Pausing a task type (admin): its pending tasks are not claimed, relayed or published and say
`type paused`, a running one finishes, and resuming publishes what waits."""

from __future__ import annotations

import uuid
from typing import Any

import httpx

from tasks_core.model import Status
from tasks_core.store.outcomes import Claim
from tasks_core.submission import Submitter, TaskIntent
from tests.integration.test_api import ALICE, ROOT


async def _submit(svc: Any, task_type: str = "diagnostics.noop") -> uuid.UUID:
    return (await Submitter(svc).submit(TaskIntent(task_type, {}), owner="alice")).task_id


async def test_a_paused_type_waits_its_running_task_finishes_and_resume_sends_the_rest(
    client: httpx.AsyncClient, svc: Any, redis_client: Any
) -> None:
    repo, registry = svc.repo, svc.registry
    running = await _submit(svc)
    claim = await repo.claim(running, registry, capacity=4, lease_seconds=30)
    assert isinstance(claim, Claim)

    r = await client.post("/task-types/diagnostics.noop/pause", headers=ROOT)
    assert r.status_code == 200 and r.json()["detail"] == "diagnostics.noop paused", r.text
    again = await client.post("/task-types/diagnostics.noop/pause", headers=ROOT)
    assert again.json()["detail"] == "diagnostics.noop was already paused"
    types = {t["task_type"]: t for t in (await client.get("/task-types", headers=ROOT)).json()}
    assert types["diagnostics.noop"]["paused"] and not types["diagnostics.sleep"]["paused"]

    redis_client.delete("durable")
    waiting = await _submit(svc)
    other = await _submit(svc, "diagnostics.sleep")  # another type is not held up
    assert (await repo.get(waiting))["last_published_at"] is None  # not sent while paused
    assert (await repo.get(other))["last_published_at"] is not None
    assert await repo.claim(waiting, registry, capacity=4, lease_seconds=30) == "type_paused"
    assert (await client.get(f"/tasks/{waiting}", headers=ALICE)).json()["waiting_reason"] == "type paused"
    assert waiting not in await repo.claim_for_publish(registry, limit=10, republish_after=0)

    # The task that was running when the type was paused finishes as usual.
    assert (
        await repo.finish(running, claim.token, registry, status=Status.SUCCESS, result={}) == Status.SUCCESS
    )

    r = await client.post("/task-types/diagnostics.noop/resume", headers=ROOT)
    assert r.status_code == 200 and r.json()["detail"] == "diagnostics.noop resumed"
    assert (await repo.get(waiting))["last_published_at"] is not None  # published at resume
    assert isinstance(await repo.claim(waiting, registry, capacity=4, lease_seconds=30), Claim)
    r = await client.post("/task-types/diagnostics.noop/resume", headers=ROOT)
    assert r.json()["detail"] == "diagnostics.noop was not paused"


async def test_only_an_admin_pauses_and_only_a_known_type(client: httpx.AsyncClient, svc: Any) -> None:
    assert (await client.post("/task-types/diagnostics.noop/pause", headers=ALICE)).status_code == 403
    assert (await client.post("/task-types/diagnostics.noop/resume", headers=ALICE)).status_code == 403
    assert (await client.post("/task-types/no.such/pause", headers=ROOT)).status_code == 404
    assert (await client.post("/task-types/diagnostics.noop/pause")).status_code == 401
    assert await svc.repo.paused_types() == []
