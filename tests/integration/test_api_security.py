"""The hardening review's findings, each against the real app, database and Redis.

Two tenants throughout: alice and bob are ordinary keys, root is an admin key.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from app.auth import parse_api_keys
from app.main import create_app
from tasks_core.services import build_services
from tests.conftest import make_settings

KEYS = "alice:alice-secret-0123456,bob:bob-secret-01234567,root:root-secret-0123456:admin"
ALICE = {"Authorization": "Bearer alice-secret-0123456"}
BOB = {"Authorization": "Bearer bob-secret-01234567"}
ROOT = {"Authorization": "Bearer root-secret-0123456"}
METRICS_TOKEN = "scrape-token-0123456789"


@pytest.fixture
async def svc(clean_db: None) -> AsyncIterator[Any]:
    services = build_services(
        make_settings(
            api_keys=KEYS, metrics_token=METRICS_TOKEN, metrics_cache_seconds=3600, diagnostics="all"
        ),
        pool_size=5,
    )
    yield services
    await services.close()



async def submit(client: httpx.AsyncClient, headers: dict[str, str], **body: Any) -> httpx.Response:
    body.setdefault("task_type", "diagnostics.noop")
    return await client.post("/tasks", json=body, headers=headers)


# ------------------------------------------------------------------ 1. dedupe keys never cross owners


async def test_a_dedupe_key_is_per_owner_and_no_answer_names_another_owners_task(
    client: httpx.AsyncClient,
) -> None:
    alices = (await submit(client, ALICE, dedupe_key="shared")).json()
    # bob takes the same key: his own task, not a 409 naming alice's.
    r = await submit(client, BOB, dedupe_key="shared")
    assert r.status_code == 202 and r.json()["id"] != alices["id"]
    bobs = r.json()
    # Each owner's duplicate names only that owner's holder.
    r = await submit(client, ALICE, dedupe_key="shared")
    assert r.status_code == 409 and r.json()["task_id"] == alices["id"]
    r = await submit(client, BOB, dedupe_key="shared")
    assert r.status_code == 409 and r.json()["task_id"] == bobs["id"]
    batch = (
        await client.post(
            "/tasks/batch",
            json={"tasks": [{"task_type": "diagnostics.noop", "dedupe_key": "shared"}]},
            headers=BOB,
        )
    ).json()
    assert batch["results"][0]["error"]["task_id"] == bobs["id"]
    assert alices["id"] not in json.dumps(batch)


async def test_dedupe_without_an_owner_still_holds_among_ownerless_tasks(svc: Any) -> None:
    from tasks_core.submission import Submitter, TaskIntent

    first = await Submitter(svc).submit(TaskIntent("diagnostics.noop", dedupe_key="k"))
    again = await Submitter(svc).submit(TaskIntent("diagnostics.noop", dedupe_key="k"))
    assert again.duplicate_of == first.task_id


# ------------------------------------------------------------------ 3. /metrics


async def test_metrics_needs_the_token_or_an_admin_key(client: httpx.AsyncClient) -> None:
    assert (await client.get("/metrics")).status_code == 401
    assert (await client.get("/metrics", headers=ALICE)).status_code == 401
    assert (await client.get("/metrics", headers={"Authorization": "Bearer wrong"})).status_code == 401
    assert (await client.get("/metrics", headers=ROOT)).status_code == 200
    token = {"Authorization": f"Bearer {METRICS_TOKEN}"}
    assert (await client.get("/metrics", headers=token)).status_code == 200
    # The token is for scraping only: it is no API key.
    assert (await client.get("/tasks", headers=token)).status_code == 401


async def test_metrics_are_served_from_a_cache_not_a_scan_per_scrape(client: httpx.AsyncClient) -> None:
    await submit(client, ALICE)
    scrapes = await asyncio.gather(*(client.get("/metrics", headers=ROOT) for _ in range(40)))
    bodies = {r.text for r in scrapes}
    assert len(bodies) == 1  # one refresh served all forty
    await submit(client, ALICE)  # the cache (an hour here) still shows one task
    again = (await client.get("/metrics", headers=ROOT)).text
    assert 'dtask_tasks{status="pending",task_type="diagnostics.noop"} 1.0' in again


# ------------------------------------------------------------------ 4. cost and leaks per request


async def test_waiting_reason_counts_only_the_owners_own_older_tasks(
    client: httpx.AsyncClient, svc: Any
) -> None:
    await client.post("/tasks/batch", json={"tasks": [{"task_type": "diagnostics.noop"}] * 30}, headers=ALICE)
    await submit(client, BOB)
    bobs = (await submit(client, BOB)).json()
    got = (await client.get(f"/tasks/{bobs['id']}", headers=BOB)).json()
    assert got["waiting_reason"].endswith("behind 1 older task of yours")
    assert "30" not in got["waiting_reason"] and "31" not in got["waiting_reason"]


async def test_waiting_reason_count_is_bounded(client: httpx.AsyncClient, svc: Any) -> None:
    from tasks_core.store.statements import WAITING_COUNT_CAP

    async with svc.engine.begin() as conn:
        await conn.execute(
            text(
                """INSERT INTO tasks (id, task_type, handler_version, owner, timeout_seconds, created_at,
                       last_published_at)
                SELECT gen_random_uuid(), 'diagnostics.noop', 1, 'alice', 60,
                       clock_timestamp() - make_interval(secs => n), clock_timestamp()
                FROM generate_series(1, :n) AS n"""
            ),
            {"n": WAITING_COUNT_CAP + 50},
        )
    mine = (await submit(client, ALICE)).json()
    got = (await client.get(f"/tasks/{mine['id']}", headers=ALICE)).json()
    assert got["waiting_reason"].endswith(f"behind more than {WAITING_COUNT_CAP:,} older tasks of yours")


async def test_counting_older_tasks_stops_at_the_cap_however_long_the_queue(svc: Any) -> None:
    """The count behind waiting_reason walks the owner's pending index newest first and stops at
    the cap; unordered, the planner built a bitmap of the whole queue first (2x slower at 100 k
    pending than at 1 k in `dtask bench scale`)."""
    from tasks_core.store.statements import waiting_facts_sql

    async with svc.engine.begin() as conn:
        await conn.execute(text(
            """INSERT INTO tasks (id, task_type, handler_version, owner, timeout_seconds, created_at)
            SELECT gen_random_uuid(), 'diagnostics.noop', 1, 'alice', 60,
                   clock_timestamp() - make_interval(secs => n)
            FROM generate_series(1, 30000) AS n"""
        ))
        await conn.execute(text("ANALYZE tasks"))
        newest = (await conn.execute(text(
            "SELECT created_at, id FROM tasks ORDER BY created_at DESC, id DESC LIMIT 1"
        ))).one()
        params = {"nb": None, "now": None, "owner": "alice", "tt": "x", "created": newest[0], "id": newest[1]}
        plan = (await conn.execute(
            text("EXPLAIN (FORMAT JSON) " + waiting_facts_sql(False)), params
        )).scalar_one()

    def nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield node
        for child in node.get("Plans", []):
            yield from nodes(child)

    limits = [n for n in nodes(plan[0]["Plan"]) if n["Node Type"] == "Limit"]
    assert [n["Plans"][0]["Node Type"] for n in limits] in (["Index Scan"], ["Index Only Scan"]), plan


@pytest.mark.parametrize("query", ["list", "summary", "waiting"])
async def test_owner_queries_can_use_an_owner_index(svc: Any, query: str) -> None:
    """With sequential scans priced out, the planner must still find an index for one owner's
    rows: the old `CAST(:owner AS text) IS NULL OR owner = :owner` form left it none."""
    sql = {
        "list": "SELECT * FROM tasks WHERE owner = 'bob' ORDER BY created_at DESC, id DESC LIMIT 51",
        "summary": "SELECT task_type, status, count(*) FROM tasks WHERE owner = 'bob' GROUP BY 1, 2",
        "waiting": """SELECT count(*) FROM (SELECT 1 FROM tasks WHERE status = 'pending' AND owner = 'bob'
                      AND (created_at, id) < (clock_timestamp(), gen_random_uuid()) LIMIT 1001) s""",
    }[query]
    async with svc.engine.connect() as conn:
        await conn.execute(text("SET enable_seqscan = off"))
        plan = "\n".join(r[0] for r in (await conn.execute(text(f"EXPLAIN {sql}"))).all())
    assert "ix_tasks_owner" in plan, plan


# ------------------------------------------------------------------ 7. crafted input is 422, never 500


def _nested(depth: int) -> str:
    return '{"task_type": "diagnostics.noop", "payload": ' + '{"a": ' * depth + "1" + "}" * depth + "}"


CRAFTED = [
    ("deep payload", "/tasks", _nested(450)),
    ("lone surrogate in payload", "/tasks", '{"task_type": "diagnostics.noop", "payload": {"x": "\\ud800"}}'),
    (
        "lone surrogate in a payload key",
        "/tasks",
        '{"task_type": "diagnostics.noop", "payload": {"\\udfff": 1}}',
    ),
    ("lone surrogate in dedupe key", "/tasks", '{"task_type": "diagnostics.noop", "dedupe_key": "\\ud800"}'),
    ("lone surrogate in task type", "/tasks", '{"task_type": "\\ud800"}'),
    ("surrogate in an unknown field", "/tasks", '{"task_type": "diagnostics.noop", "\\ud800": 1}'),
    ("deep batch entry", "/tasks/batch", '{"tasks": [' + _nested(450) + "]}"),
]


@pytest.mark.parametrize(("what", "path", "raw"), CRAFTED, ids=[c[0] for c in CRAFTED])
async def test_crafted_bodies_are_422(
    client: httpx.AsyncClient, svc: Any, what: str, path: str, raw: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        r = await client.post(path, content=raw, headers={**ALICE, "content-type": "application/json"})
    # At most one log line, never a traceback (the defect logged hundreds of lines per request).
    assert len(caplog.records) <= 1 and not any(rec.exc_info for rec in caplog.records), caplog.text
    if path == "/tasks/batch" and r.status_code == 202:
        assert r.json()["accepted"] == 0 and r.json()["results"][0]["error"]["field"] == "payload"
    else:
        assert r.status_code == 422, r.text
    r.json()  # a well-formed JSON answer
    assert (await svc.repo.summary())["total"] == 0


@pytest.mark.parametrize(
    "stamp", ["0001-01-01T00:00:00+23:59", "9999-12-31T23:59:59-23:59", "0001-01-01T00:00:00+00:00"]
)
async def test_cursors_at_the_edge_of_time_are_422_or_an_empty_page(
    client: httpx.AsyncClient, stamp: str
) -> None:
    import base64

    raw = f"{stamp}|{uuid.UUID(int=0)}".encode()
    cursor = base64.urlsafe_b64encode(raw).decode().rstrip("=")
    r = await client.get("/tasks", params={"cursor": cursor}, headers=ALICE)
    assert r.status_code in (200, 422), r.text


# ------------------------------------------------------------------ 8. API keys


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("alice:same-secret-0123456789,root:same-secret-0123456789:admin", "same secret"),
        ("alice:short", "shorter than 16"),
        ("cli:cli-secret-0123456789", "reserved"),
        ("alice:alice-secret-0123456,alice:other-secret-0123456", "duplicate key name"),
    ],
)
def test_ambiguous_or_weak_keys_are_refused_at_start(raw: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_api_keys(raw)


# ------------------------------------------------------------------ 9. no internals to anyone


@pytest.fixture
def dead_port() -> Iterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    yield port


async def test_readyz_names_the_failing_fact_without_internals(clean_db: None, dead_port: int) -> None:
    bad = build_services(
        make_settings(api_keys=KEYS, database_url=f"postgresql+asyncpg://secretrole@127.0.0.1:{dead_port}/x"),
        pool_size=1,
    )
    app = create_app(services=bad)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.get("/readyz")
        assert r.status_code == 503
        assert r.json()["facts"]["postgres"]["ok"] is False
        assert "secretrole" not in r.text and str(dead_port) not in r.text and "Error" not in r.text
    finally:
        await bad.close()


async def test_a_publish_failure_shown_to_owners_names_no_host(
    client: httpx.AsyncClient, svc: Any, dead_port: int
) -> None:
    from celery import Celery

    from tasks_core.duties.relay import publish_ids
    from tasks_core.transport import CeleryTransport

    tid = (await submit(client, ALICE)).json()["id"]
    # A real broker address where nothing listens.
    unreachable = Celery("unreachable", broker=f"redis://127.0.0.1:{dead_port}/0")
    unreachable.conf.broker_connection_timeout = 1
    svc.transport = CeleryTransport(unreachable)
    error = await publish_ids(svc, [uuid.UUID(tid)], by="test")
    assert error is not None
    got = (await client.get(f"/tasks/{tid}", headers=ALICE)).json()
    assert got["waiting_reason"].startswith("publish failed: ")
    assert str(dead_port) not in json.dumps(got) and "127.0.0.1" not in json.dumps(got)
