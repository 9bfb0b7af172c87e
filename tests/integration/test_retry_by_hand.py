"""Retry by hand (POST /tasks/{id}/retry, POST /tasks/retry, `dtask retry`) and every attempt's
record (GET /tasks/{id}/attempts), through the real API on the real database; tasks end failed
by running their real handlers in-process, as a worker would."""

from __future__ import annotations

import uuid
from typing import Any

import httpx

from tasks_core.worker.runtime import run_task
from tests.integration.test_api import ALICE, BOB, ROOT


async def _failed(client: httpx.AsyncClient, svc: Any, headers: dict[str, str] = ALICE, **body: Any) -> str:
    r = await client.post("/tasks", headers=headers, json={"task_type": "diagnostics.fail", **body})
    assert r.status_code == 202, r.text
    task_id = r.json()["id"]
    assert (await run_task(svc, task_id)).status == "failed"
    return str(task_id)


async def test_a_failed_task_is_retried_once_as_a_new_task_linked_both_ways(
    client: httpx.AsyncClient, svc: Any
) -> None:
    svc.settings.worker_run_next = 0
    old = await _failed(client, svc, payload={"message": "boom"}, priority=4, timeout_seconds=77)
    r = await client.post(f"/tasks/{old}/retry", headers=ALICE)
    assert r.status_code == 202, r.text
    new = r.json()
    assert new["id"] != old and new["retry_of"] == old and new["status"] == "pending"
    assert (new["task_type"], new["priority"], new["timeout_seconds"]) == ("diagnostics.fail", 4, 77)
    stored = await svc.repo.get(uuid.UUID(new["id"]))
    assert stored["payload"] == {"message": "boom"} and stored["owner"] == "alice"
    assert (await client.get(f"/tasks/{old}", headers=ALICE)).json()["retried_by"] == new["id"]

    again = await client.post(f"/tasks/{old}/retry", headers=ALICE)  # a double click
    assert again.status_code == 409 and again.json()["task_id"] == new["id"], again.text
    assert (await svc.repo.summary())["total"] == 2


async def test_only_your_failed_or_cancelled_tasks_are_retried(client: httpx.AsyncClient, svc: Any) -> None:
    svc.settings.worker_run_next = 0
    pending = (await client.post("/tasks", headers=ALICE, json={"task_type": "diagnostics.noop"})).json()[
        "id"
    ]
    r = await client.post(f"/tasks/{pending}/retry", headers=ALICE)
    assert r.status_code == 409 and "failed or cancelled" in r.json()["detail"], r.text
    assert (await client.post(f"/tasks/{pending}/cancel", headers=ALICE)).status_code == 200
    assert (await client.post(f"/tasks/{pending}/retry", headers=ALICE)).status_code == 202  # cancelled: yes

    alices = await _failed(client, svc)
    assert (await client.post(f"/tasks/{alices}/retry", headers=BOB)).status_code == 404  # not bob's
    assert (await client.post(f"/tasks/{uuid.uuid4()}/retry", headers=ALICE)).status_code == 404
    r = await client.post(f"/tasks/{alices}/retry", headers=ROOT)  # an admin may; the owner stays
    assert r.status_code == 202 and (await svc.repo.get(uuid.UUID(r.json()["id"])))["owner"] == "alice"


async def test_a_retry_honours_the_dedupe_key(client: httpx.AsyncClient, svc: Any) -> None:
    svc.settings.worker_run_next = 0
    old = await _failed(client, svc, dedupe_key="nightly")
    holder = (await client.post("/tasks", headers=ALICE, json={"task_type": "diagnostics.noop",
                                                               "dedupe_key": "nightly"})).json()  # fmt: skip
    # another type: the key is per type, so this does not hold it
    assert (await client.post(f"/tasks/{old}/retry", headers=ALICE)).status_code == 202
    old2 = await _failed(client, svc, dedupe_key="weekly")
    blocker = (await client.post("/tasks", headers=ALICE, json={"task_type": "diagnostics.fail",
                                                                "dedupe_key": "weekly"})).json()  # fmt: skip
    r = await client.post(f"/tasks/{old2}/retry", headers=ALICE)
    assert r.status_code == 409 and r.json()["task_id"] == blocker["id"], r.text
    assert (await svc.repo.get(uuid.UUID(old2)))["retried_by"] is None  # nothing linked, nothing stored
    assert holder["id"]


async def test_bulk_retry_answers_each_entry_in_order(client: httpx.AsyncClient, svc: Any) -> None:
    svc.settings.worker_run_next = 0
    first, second = await _failed(client, svc), await _failed(client, svc)
    running_or_pending = (
        await client.post("/tasks", headers=ALICE, json={"task_type": "diagnostics.noop"})
    ).json()
    ids = [first, str(uuid.uuid4()), running_or_pending["id"], second, first]
    r = await client.post("/tasks/retry", headers=ALICE, json={"ids": ids})
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["accepted"] == 2
    codes = [e["error"]["code"] if e["error"] else "ok" for e in body["results"]]
    assert codes == ["ok", "not_found", "not_retryable", "ok", "retried"]
    assert body["results"][4]["error"]["task_id"] == body["results"][0]["task"]["id"]
    assert (await client.post("/tasks/retry", headers=ALICE, json={"ids": []})).status_code == 422
    assert (await client.post("/tasks/retry", headers=ALICE, json={"ids": ["x"]})).status_code == 422


async def test_every_attempt_keeps_its_error(client: httpx.AsyncClient, svc: Any) -> None:
    from datetime import timedelta

    svc.settings.worker_run_next = 0
    r = await client.post(
        "/tasks", headers=ALICE, json={"task_type": "diagnostics.flaky", "payload": {"fail_times": 2}}
    )
    task_id = r.json()["id"]
    for _ in range(3):
        row = await svc.repo.get(uuid.UUID(task_id))
        svc.repo.now = row["not_before"] + timedelta(milliseconds=1) if row["not_before"] else None
        await run_task(svc, task_id)
        svc.repo.now = None
    assert (await svc.repo.get(uuid.UUID(task_id)))["status"] == "success"
    r = await client.get(f"/tasks/{task_id}/attempts", headers=ALICE)
    assert r.status_code == 200, r.text
    items = r.json()["items"]
    assert [(a["attempt"], a["outcome"]) for a in items] == [(1, "retry"), (2, "retry"), (3, "success")]
    assert "attempt 1 fails on purpose" in items[0]["error"] and "attempt 2" in items[1]["error"]
    assert items[2]["error"] is None and all(a["ended_at"] and a["worker"] for a in items)
    assert (await client.get(f"/tasks/{task_id}/attempts", headers=BOB)).status_code == 404
