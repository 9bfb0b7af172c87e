"""HTTP API against the real app, a real database and a real Redis (no server process needed:
httpx drives the ASGI app in this event loop)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from app.main import create_app
from tasks_core import metrics as runtime_metrics
from tasks_core.duties.readiness import READINESS_KEY, write_readiness
from tasks_core.services import build_services
from tests.conftest import make_settings
from tests.integration.conftest import KEYS

ALICE = {"Authorization": "Bearer alice-secret-0123456"}
BOB = {"Authorization": "Bearer bob-secret-01234567"}
ROOT = {"Authorization": "Bearer root-secret-0123456"}


async def post_task(
    client: httpx.AsyncClient, headers: dict[str, str] = ALICE, **body: Any
) -> httpx.Response:
    body.setdefault("task_type", "diagnostics.noop")
    return await client.post("/tasks", json=body, headers=headers)


async def total(svc: Any) -> int:
    return int((await svc.repo.summary())["total"])


async def test_every_route_but_health_needs_a_key(client: httpx.AsyncClient) -> None:
    tid = uuid.uuid4()
    calls = [
        ("POST", "/tasks"),
        ("POST", "/tasks/batch"),
        ("GET", "/tasks"),
        ("GET", "/tasks/summary"),
        ("GET", f"/tasks/{tid}"),
        ("POST", f"/tasks/{tid}/cancel"),
        ("DELETE", f"/tasks/{tid}"),
    ]
    for method, path in calls:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "Basic alice-secret-0123456"},
        ):
            r = await client.request(method, path, headers=headers, json={})
            assert r.status_code == 401, (method, path, headers)
    assert (await client.get("/healthz")).status_code == 200


async def test_submit_returns_the_task_and_publishes_it(
    client: httpx.AsyncClient, svc: Any, redis_client: Any
) -> None:
    r = await post_task(
        client, task_type="diagnostics.sleep", payload={"seconds": 1}, timeout_seconds=30, dedupe_key="k1"
    )
    assert r.status_code == 202
    task = r.json()
    assert task["status"] == "pending" and task["task_type"] == "diagnostics.sleep"
    assert task["handler_version"] == 1 and task["timeout_seconds"] == 30 and task["dedupe_key"] == "k1"
    assert task["cancel_requested"] is False and task["attempt_count"] == 0
    assert redis_client.llen("durable") == 1
    row = await svc.repo.get(uuid.UUID(task["id"]))
    assert row["owner"] == "alice"  # the key's name, never its secret
    got = (await client.get(f"/tasks/{task['id']}", headers=ALICE)).json()
    assert got["waiting_reason"] == "waiting for a worker"


async def test_active_duplicate_is_409_with_the_holder(client: httpx.AsyncClient, svc: Any) -> None:
    first = (await post_task(client, dedupe_key="same")).json()
    r = await post_task(client, dedupe_key="same")
    assert r.status_code == 409 and r.json()["task_id"] == first["id"]
    assert await total(svc) == 1


async def test_concurrent_posts_share_commits_and_each_gets_its_own_answer(
    client: httpx.AsyncClient, svc: Any
) -> None:
    """Group commit over HTTP: 30 concurrent POST /tasks from two keys, ten of them racing for one
    dedupe key. Every plain one gets its own task (owned by its key), the racers one 202 and
    nine 409 naming it, and an invalid one its own 422 without failing the others."""
    plain = [post_task(client, ALICE if i % 2 else BOB, payload={"i": i}) for i in range(19)]
    racers = [post_task(client, dedupe_key="nightly") for _ in range(10)]
    bad = [post_task(client, timeout_seconds=-1)]
    answers = await asyncio.gather(*plain, *racers, *bad)
    created = answers[:19]
    assert [r.status_code for r in created] == [202] * 19
    assert len({r.json()["id"] for r in created}) == 19
    for i, r in enumerate(created):
        row = await svc.repo.get(uuid.UUID(r.json()["id"]))
        assert row["payload"] == {"i": i} and row["owner"] == ("alice" if i % 2 else "bob")
    race = answers[19:29]
    winner = [r.json()["id"] for r in race if r.status_code == 202]
    assert len(winner) == 1
    assert sorted(r.status_code for r in race) == [202] + [409] * 9
    assert all(r.json()["task_id"] == winner[0] for r in race if r.status_code == 409)
    assert answers[29].status_code == 422
    assert await total(svc) == 20
    assert svc.submit_group.groups < 20  # they shared transactions


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"task_type": "no.such.type"}, "task_type"),
        ({"handler_version": 7}, "handler_version"),
        ({"handler_version": True}, "handler_version"),
        ({"payload": [1, 2]}, "payload"),
        ({"payload": "text"}, "payload"),
        ({"payload": {"blob": "x" * 5000}}, "payload"),
        ({"timeout_seconds": 0}, "timeout_seconds"),
        ({"timeout_seconds": -5}, "timeout_seconds"),
        ({"timeout_seconds": 1e9}, "timeout_seconds"),
        ({"timeout_seconds": "soon"}, "timeout_seconds"),
        ({"dedupe_key": "k" * 500}, "dedupe_key"),
        ({"dedupe_key": ""}, "dedupe_key"),
        ({"task_type": 5}, "task_type"),
        ({"surprise": 1}, "surprise"),
        ({"payload": {"text": "nul \u0000 byte"}}, "payload"),
        ({"payload": {"nul \u0000 key": 1}}, "payload"),
        ({"dedupe_key": "a\u0000b"}, "dedupe_key"),
    ],
)
async def test_bad_input_is_422_and_stores_nothing(
    client: httpx.AsyncClient, svc: Any, body: dict[str, Any], field: str
) -> None:
    r = await post_task(client, **body)
    assert r.status_code == 422, r.text
    assert any(field in map(str, err["loc"]) for err in r.json()["detail"]), r.json()
    assert await total(svc) == 0


async def test_non_finite_timeouts_are_422(client: httpx.AsyncClient, svc: Any) -> None:
    for raw in (
        '{"task_type": "diagnostics.noop", "timeout_seconds": Infinity}',
        '{"task_type": "diagnostics.noop", "timeout_seconds": NaN}',
        '{"task_type": "diagnostics.noop", "timeout_seconds": 1e400}',
    ):
        r = await client.post("/tasks", content=raw, headers={**ALICE, "content-type": "application/json"})
        assert r.status_code == 422, raw
    assert await total(svc) == 0


async def test_huge_request_body_is_refused_unread(client: httpx.AsyncClient, svc: Any) -> None:
    r = await client.post(
        "/tasks",
        content=b'{"payload": "' + b"x" * 300_000 + b'"}',
        headers={**ALICE, "content-type": "application/json"},
    )
    assert r.status_code == 413
    assert await total(svc) == 0


async def test_unknown_and_malformed_ids(client: httpx.AsyncClient) -> None:
    assert (await client.get(f"/tasks/{uuid.uuid4()}", headers=ALICE)).status_code == 404
    assert (await client.get("/tasks/not-a-uuid", headers=ALICE)).status_code == 422
    assert (await client.post(f"/tasks/{uuid.uuid4()}/cancel", headers=ALICE)).status_code == 404
    assert (await client.delete(f"/tasks/{uuid.uuid4()}", headers=ALICE)).status_code == 404


async def test_owners_are_isolated_and_admin_sees_all(client: httpx.AsyncClient) -> None:
    mine = (await post_task(client, headers=ALICE)).json()["id"]
    theirs = (await post_task(client, headers=BOB)).json()["id"]
    assert (await client.get(f"/tasks/{theirs}", headers=ALICE)).status_code == 404
    assert (await client.post(f"/tasks/{theirs}/cancel", headers=ALICE)).status_code == 404
    assert (await client.delete(f"/tasks/{theirs}", headers=ALICE)).status_code == 404
    assert [t["id"] for t in (await client.get("/tasks", headers=ALICE)).json()["items"]] == [mine]
    assert (await client.get("/tasks/summary", headers=ALICE)).json()["total"] == 1
    assert {t["id"] for t in (await client.get("/tasks", headers=ROOT)).json()["items"]} == {mine, theirs}
    assert (await client.get("/tasks/summary", headers=ROOT)).json()["total"] == 2
    assert (await client.get(f"/tasks/{theirs}", headers=ROOT)).status_code == 200
    assert (await client.get(f"/tasks/{theirs}", headers=BOB)).json()["status"] == "pending"  # untouched


async def test_batch_commits_valid_entries_and_reports_each_error(
    client: httpx.AsyncClient, svc: Any, redis_client: Any
) -> None:
    holder = (await post_task(client, dedupe_key="taken")).json()["id"]
    body = {
        "tasks": [
            {"task_type": "diagnostics.noop", "payload": {"n": 1}},
            {"task_type": "nope"},
            {"task_type": "diagnostics.noop", "dedupe_key": "taken"},
            {"task_type": "diagnostics.sleep", "payload": {"seconds": 0}},
        ]
    }
    r = await client.post("/tasks/batch", json=body, headers=ALICE)
    assert r.status_code == 202
    out = r.json()
    assert out["accepted"] == 2 and out["published"] is True
    results = out["results"]
    assert results[0]["task"]["status"] == "pending"
    assert results[1]["error"]["code"] == "invalid" and results[1]["error"]["field"] == "task_type"
    assert results[2]["error"] == {
        "code": "duplicate",
        "field": None,
        "message": "an active task holds this dedupe key",
        "task_id": holder,
    }
    assert results[3]["task"]["task_type"] == "diagnostics.sleep"
    assert await total(svc) == 3
    assert redis_client.llen("durable") == 3


async def test_batch_limits(client: httpx.AsyncClient, svc: Any) -> None:
    too_many = {"tasks": [{"task_type": "diagnostics.noop"}] * 1001}
    assert (await client.post("/tasks/batch", json=too_many, headers=ALICE)).status_code in (413, 422)
    assert (await client.post("/tasks/batch", json={"tasks": []}, headers=ALICE)).status_code == 422
    assert await total(svc) == 0


async def test_cancel_pending_running_and_terminal(client: httpx.AsyncClient, svc: Any) -> None:
    pending = (await post_task(client)).json()["id"]
    r = await client.post(f"/tasks/{pending}/cancel", headers=ALICE)
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    assert (await client.post(f"/tasks/{pending}/cancel", headers=ALICE)).status_code == 409

    running = (await post_task(client, task_type="diagnostics.sleep")).json()["id"]
    claim = await svc.repo.claim(uuid.UUID(running), svc.registry, capacity=4, lease_seconds=30)
    assert not isinstance(claim, str)
    r = await client.post(f"/tasks/{running}/cancel", headers=ALICE)
    assert r.status_code == 202
    assert r.json()["status"] == "running" and r.json()["cancel_requested"] is True


async def test_delete_only_finished_tasks(client: httpx.AsyncClient, svc: Any) -> None:
    tid = (await post_task(client)).json()["id"]
    assert (await client.delete(f"/tasks/{tid}", headers=ALICE)).status_code == 409
    await client.post(f"/tasks/{tid}/cancel", headers=ALICE)
    assert (await client.delete(f"/tasks/{tid}", headers=ALICE)).status_code == 204
    assert (await client.get(f"/tasks/{tid}", headers=ALICE)).status_code == 404


async def test_listing_pages_through_more_than_200_tasks(client: httpx.AsyncClient, svc: Any) -> None:
    body = {"tasks": [{"task_type": "diagnostics.noop", "payload": {"i": i}} for i in range(230)]}
    assert (await client.post("/tasks/batch", json=body, headers=ALICE)).json()["accepted"] == 230
    seen: list[str] = []
    cursor = None
    while True:
        params = {"limit": 40, **({"cursor": cursor} if cursor else {})}
        page = (await client.get("/tasks", params=params, headers=ALICE)).json()
        seen += [t["id"] for t in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert len(seen) == 230 == len(set(seen))
    summary = (await client.get("/tasks/summary", headers=ALICE)).json()
    assert summary["by_status"]["pending"] == 230 and summary["by_type"] == {
        "diagnostics.noop": {"pending": 230}
    }
    filtered = (await client.get("/tasks", params={"status": "success"}, headers=ALICE)).json()
    assert filtered == {"items": [], "next_cursor": None}
    assert (await client.get("/tasks", params={"cursor": "%%%"}, headers=ALICE)).status_code == 422
    assert (await client.get("/tasks", params={"status": "bogus"}, headers=ALICE)).status_code == 422
    assert (await client.get("/tasks", params={"task_type": "a\x00b"}, headers=ALICE)).status_code == 422


async def test_waiting_reason_names_a_publish_failure(client: httpx.AsyncClient, svc: Any) -> None:
    tid = (await post_task(client)).json()["id"]
    await svc.repo.mark_publish_failed([uuid.UUID(tid)], "ConnectionError: broker down")
    got = (await client.get(f"/tasks/{tid}", headers=ALICE)).json()
    assert got["waiting_reason"] == "publish failed: ConnectionError: broker down"


# ------------------------------------------------------------------ readiness


async def test_readyz_needs_a_fresh_readiness_fact(
    client: httpx.AsyncClient, svc: Any, redis_client: Any
) -> None:
    r = await client.get("/readyz")
    assert r.status_code == 503
    facts = r.json()["facts"]
    assert facts["postgres"]["ok"] and facts["redis"]["ok"] and not facts["readiness"]["ok"]
    await write_readiness(svc)
    r = await client.get("/readyz")
    assert r.status_code == 200 and r.json()["ready"] is True
    redis_client.set(READINESS_KEY, json.dumps({"worker": "w", "written_at": time.time() - 3600}))
    r = await client.get("/readyz")
    assert r.status_code == 503 and "stale" in r.json()["facts"]["readiness"]["detail"]


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port that accepts connections and never answers (a hung dependency)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock.getsockname()[1]
    sock.close()


@pytest.mark.parametrize("broken", ["postgres", "redis", "postgres-hangs", "redis-hangs"])
async def test_readyz_names_the_failing_dependency(clean_db: None, silent_port: int, broken: str) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()  # nothing listens here
    port = silent_port if broken.endswith("hangs") else dead_port
    overrides: dict[str, Any] = {}
    if broken.startswith("postgres"):
        overrides["database_url"] = f"postgresql+asyncpg://postgres@127.0.0.1:{port}/x"
    else:
        overrides["redis_url"] = f"redis://127.0.0.1:{port}/0"
    bad = build_services(make_settings(api_keys=KEYS, **overrides), pool_size=1)
    app = create_app(services=bad)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            started = time.monotonic()
            r = await c.get("/readyz")
            elapsed = time.monotonic() - started
        assert r.status_code == 503
        facts = r.json()["facts"]
        name = broken.split("-")[0]
        assert facts[name]["ok"] is False and facts[name]["detail"]
        assert elapsed < 2.0  # the promised bound for a route with a store down, not a performance target
    finally:
        await bad.close()


async def test_an_exhausted_connection_pool_answers_503_not_500(clean_db: None) -> None:
    """Every pooled connection busy past the wait (a burst of clients) is a dependency that is
    briefly unavailable: 503 with Retry-After, like a database blink, never a 500."""
    busy = build_services(make_settings(api_keys=KEYS), pool_size=1, max_overflow=0)
    app = create_app(services=busy)
    try:
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        async with busy.engine.connect(), client:  # the connect() holds the only pooled connection
            r = await client.get(f"/tasks/{uuid.uuid4()}", headers=ALICE)
        assert r.status_code == 503, r.text
        assert r.json()["dependency"] == "postgres" and r.headers["Retry-After"]
    finally:
        await busy.close()


async def test_metrics_exports_tasks_and_shared_counters(client: httpx.AsyncClient, svc: Any) -> None:
    await post_task(client)
    async with svc.engine.begin() as conn:
        await conn.execute(text("UPDATE tasks SET created_at = clock_timestamp() - interval '90 seconds'"))
    await runtime_metrics.flush(svc.redis)  # deltas left by earlier tests in this process...
    await svc.redis.delete(runtime_metrics.METRICS_KEY)  # ...are not this test's
    runtime_metrics.CLAIMS.inc(3)
    runtime_metrics.LEASE_LOST.inc()
    runtime_metrics.HANDLER_SECONDS.labels(task_type="diagnostics.noop").observe(0.5)
    await runtime_metrics.flush(svc.redis)
    r = await client.get("/metrics", headers=ROOT)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text_ = r.text
    assert 'dtask_tasks{status="pending",task_type="diagnostics.noop"} 1.0' in text_
    assert "dtask_claims_total 3.0" in text_
    assert "dtask_lease_lost_total 1.0" in text_
    assert 'dtask_handler_seconds_bucket{le="1.0",task_type="diagnostics.noop"} 1.0' in text_
    age = next(line for line in text_.splitlines() if line.startswith("dtask_oldest_pending_age_seconds "))
    assert float(age.split()[1]) >= 89


async def test_a_request_waits_for_a_briefly_busy_pool_instead_of_failing(clean_db: None) -> None:
    """A burst (every pooled connection held for a while, as concurrent batches hold them) queues
    for up to DTASK_API_POOL_WAIT_SECONDS; the api answers the request instead of a 503/500."""
    settings = make_settings(api_keys=KEYS)
    busy = build_services(  # as the api builds its own (app.main), with a pool of one
        settings, pool_size=1, max_overflow=0, statement_seconds=settings.api_database_timeout_seconds,
        pool_wait_seconds=settings.api_pool_wait_seconds,
    )
    app = create_app(services=busy)

    async def hold_the_only_connection() -> None:
        async with busy.engine.connect():
            await asyncio.sleep(2.0)  # longer than the statement deadline, shorter than the wait

    try:
        holder = asyncio.create_task(hold_the_only_connection())
        await asyncio.sleep(0.2)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        async with client:
            r = await client.get(f"/tasks/{uuid.uuid4()}", headers=ALICE)
        await holder
        assert r.status_code == 404, r.text  # answered: an unknown id, not "postgres unavailable"
    finally:
        await busy.close()


async def test_metrics_count_the_api_s_own_publishes_and_publish_failures(
    client: httpx.AsyncClient, svc: Any
) -> None:
    """Publishes made at submit time by the api process reach /metrics (not only workers')."""
    from celery import Celery

    from tasks_core.transport import CeleryTransport

    await runtime_metrics.flush(svc.redis)  # deltas left by earlier tests in this process...
    await svc.redis.delete(runtime_metrics.METRICS_KEY)  # ...are not this test's
    for _ in range(2):
        assert (await post_task(client)).status_code == 202
    dead = dataclasses.replace(svc, transport=CeleryTransport(Celery("dead", broker="redis://127.0.0.1:1/0")))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(services=dead)), base_url="http://t"
    ) as unpublished:
        r = await post_task(unpublished)
    assert r.status_code == 202 and r.json()["status"] == "pending"
    text_ = (await client.get("/metrics", headers=ROOT)).text
    assert 'dtask_published_total{by="submit"} 2.0' in text_, text_
    assert "dtask_publish_failures_total 1.0" in text_


async def test_openapi_describes_every_route(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/openapi.json")).json()
    paths = doc["paths"]
    for path in (
        "/tasks",
        "/tasks/batch",
        "/tasks/summary",
        "/tasks/{task_id}",
        "/tasks/{task_id}/cancel",
        "/healthz",
        "/readyz",
        "/metrics",
    ):
        assert path in paths
    assert "409" in paths["/tasks"]["post"]["responses"]
    assert "202" in paths["/tasks/{task_id}/cancel"]["post"]["responses"]


async def test_openapi_documents_auth_every_route_and_every_field(client: httpx.AsyncClient) -> None:
    """Swagger's "Authorize" works (a bearer scheme), and a newcomer reads what each route, status
    code and field means."""
    doc = (await client.get("/openapi.json")).json()
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            assert op.get("description") or op.get("summary"), f"{method} {path} has no description"
            if not path.startswith(("/healthz", "/readyz", "/metrics")):
                assert "401" in op["responses"], f"{method} {path} does not document 401"
                assert op.get("security"), f"{method} {path} does not declare the bearer scheme"
    for name, schema in doc["components"]["schemas"].items():
        if name in ("HTTPValidationError", "ValidationError") or "properties" not in schema:
            continue
        for field, spec in schema["properties"].items():
            assert spec.get("description"), f"{name}.{field} has no description"


async def test_http_submission_takes_and_shows_run_at_delay_and_priority(client: httpx.AsyncClient) -> None:
    later = {"task_type": "diagnostics.noop", "delay_seconds": 3600, "priority": 9}
    r = await client.post("/tasks", headers=ALICE, json=later)
    assert r.status_code == 202, r.text
    task = r.json()
    assert task["priority"] == 9 and task["run_at"] and task["waiting_reason"].startswith("scheduled for ")
    got = (await client.get(f"/tasks/{task['id']}", headers=ALICE)).json()
    assert got["run_at"] == task["run_at"] and got["waiting_reason"] == f"scheduled for {task['run_at']}"

    both = {"task_type": "diagnostics.noop", "run_at": "2030-01-01T00:00:00Z", "delay_seconds": 1}
    for body in (both, {"task_type": "diagnostics.noop", "run_at": "2030-01-01T00:00:00"},
                 {"task_type": "diagnostics.noop", "priority": 500}):  # fmt: skip
        r = await client.post("/tasks", json=body, headers=ALICE)
        assert r.status_code == 422, r.text
    batch = {"tasks": [{"task_type": "diagnostics.noop", "priority": 3},
                       {"task_type": "diagnostics.noop", "run_at": "2030-01-01T00:00:00Z"}]}  # fmt: skip
    r = await client.post("/tasks/batch", json=batch, headers=ALICE)
    assert r.status_code == 202, r.text
    tasks = [e["task"] for e in r.json()["results"]]
    assert tasks[0]["priority"] == 3 and tasks[1]["run_at"] == "2030-01-01T00:00:00Z"
    assert tasks[1]["waiting_reason"] == "scheduled for 2030-01-01T00:00:00Z"
