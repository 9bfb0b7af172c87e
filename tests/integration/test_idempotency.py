"""Idempotency-Key on POST /tasks and /tasks/batch: a retried request gets the first one's tasks
(per owner, kept 24 h), on the real app, database and Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tasks_core.services import build_services
from tests.conftest import make_settings

KEYS = "alice:alice-secret-0123456,bob:bob-secret-01234567"
ALICE = {"Authorization": "Bearer alice-secret-0123456"}
BOB = {"Authorization": "Bearer bob-secret-01234567"}
BODY = {"task_type": "diagnostics.noop", "payload": {"n": 1}}


@pytest.fixture
async def svc(clean_db: None) -> AsyncIterator[Any]:
    services = build_services(make_settings(api_keys=KEYS, diagnostics="all"), pool_size=10)
    yield services
    await services.close()



async def total(svc: Any) -> int:
    return int((await svc.repo.summary())["total"])


async def test_a_retry_with_the_same_key_returns_the_same_task(client: httpx.AsyncClient, svc: Any) -> None:
    first = await client.post("/tasks", json=BODY, headers={**ALICE, "Idempotency-Key": "k1"})
    again = await client.post("/tasks", json=BODY, headers={**ALICE, "Idempotency-Key": "k1"})
    assert first.status_code == 202 and again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert await total(svc) == 1
    # Without a key, or with another key, a new task.
    assert (await client.post("/tasks", json=BODY, headers=ALICE)).status_code == 202
    assert (
        await client.post("/tasks", json=BODY, headers={**ALICE, "Idempotency-Key": "k2"})
    ).status_code == 202
    assert await total(svc) == 3


async def test_keys_are_per_owner(client: httpx.AsyncClient, svc: Any) -> None:
    a = await client.post("/tasks", json=BODY, headers={**ALICE, "Idempotency-Key": "same"})
    b = await client.post("/tasks", json=BODY, headers={**BOB, "Idempotency-Key": "same"})
    assert a.status_code == b.status_code == 202 and a.json()["id"] != b.json()["id"]


async def test_the_same_key_with_another_request_is_refused(client: httpx.AsyncClient, svc: Any) -> None:
    await client.post("/tasks", json=BODY, headers={**ALICE, "Idempotency-Key": "k"})
    other = {**BODY, "payload": {"n": 2}}
    r = await client.post("/tasks", json=other, headers={**ALICE, "Idempotency-Key": "k"})
    assert r.status_code == 422 and "different request" in r.text
    assert await total(svc) == 1


async def test_racing_retries_create_one_task(client: httpx.AsyncClient, svc: Any) -> None:
    answers = await asyncio.gather(
        *(client.post("/tasks", json=BODY, headers={**ALICE, "Idempotency-Key": "race"}) for _ in range(8))
    )
    assert sorted(r.status_code for r in answers) == [200] * 7 + [202]
    assert len({r.json()["id"] for r in answers}) == 1 and await total(svc) == 1


async def test_a_batch_retry_returns_the_first_batchs_tasks_and_errors(
    client: httpx.AsyncClient, svc: Any
) -> None:
    batch = {"tasks": [BODY, {"task_type": "nope"}, {**BODY, "payload": {"n": 3}}]}
    first = await client.post("/tasks/batch", json=batch, headers={**ALICE, "Idempotency-Key": "b"})
    again = await client.post("/tasks/batch", json=batch, headers={**ALICE, "Idempotency-Key": "b"})
    assert first.status_code == 202 and again.status_code == 200
    ids = lambda r: [e["task"]["id"] if e["task"] else e["error"]["code"] for e in r.json()["results"]]  # noqa: E731
    assert ids(first) == ids(again) and ids(first)[1] == "invalid"
    assert await total(svc) == 2


async def test_an_expired_key_is_a_new_request(client: httpx.AsyncClient, svc: Any) -> None:
    await client.post("/tasks", json=BODY, headers={**ALICE, "Idempotency-Key": "old"})
    async with svc.engine.begin() as conn:
        from sqlalchemy import text

        await conn.execute(text("UPDATE idempotency_keys SET created_at = created_at - interval '25 hours'"))
    r = await client.post("/tasks", json=BODY, headers={**ALICE, "Idempotency-Key": "old"})
    assert r.status_code == 202 and await total(svc) == 2
    assert await svc.repo.prune_idempotency_keys() == 0  # the renewed key is young again
