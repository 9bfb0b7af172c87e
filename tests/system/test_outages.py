"""A database or broker blink delays a task, it does not kill it.

Each test owns its PostgreSQL and Redis (embedded servers under tmp; never the machine's own), so
it can crash, restart and pause them, while real `celery worker`/`beat` processes and a real
`dtask api` run against them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from sqlalchemy import text

from tasks_core.devkit import outage
from tasks_core.devkit.embedded import EmbeddedPostgres, EmbeddedRedis, create_database, free_port
from tasks_core.services import build_services
from tasks_core.submission import Submitter, TaskIntent
from tests.conftest import make_settings
from tests.system.conftest import ROOT, Cluster, wait_for

pytestmark = pytest.mark.system
KEY = "outage-secret-0123456789"


@dataclass
class Owned:
    pg: EmbeddedPostgres
    redis: EmbeddedRedis
    database_url: str
    broker_url: str

    def env(self, **extra: str) -> dict[str, str]:
        return {
            "DTASK_DATABASE_URL": self.database_url,
            "DTASK_BROKER_URL": self.broker_url,
            "DTASK_REDIS_URL": self.broker_url,
            **extra,
        }


@pytest.fixture(scope="module")
def owned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Owned]:
    from alembic import command

    from tasks_core.db import alembic_config

    root = tmp_path_factory.mktemp("owned")
    pg, redis = EmbeddedPostgres(root / "pg"), EmbeddedRedis(root / "redis")
    admin = pg.start()
    url = create_database(admin, "outage")
    command.upgrade(alembic_config(url), "head")
    try:
        yield Owned(pg, redis, url, redis.start())
    finally:
        redis.stop()
        pg.stop()


@pytest.fixture
async def svc(owned: Owned) -> AsyncIterator[Any]:
    """This process's view of the owned database (for submitting and reading rows)."""
    services = build_services(
        make_settings(
            database_url=owned.database_url, broker_url=owned.broker_url, redis_url=owned.broker_url
        ),
        pool_size=4,
    )
    async with services.engine.begin() as conn:
        await conn.execute(
            text("TRUNCATE tasks, task_attempts, task_slots, diagnostics_runs, diagnostics_effects CASCADE")
        )
    yield services
    await services.close()


async def rows(svc: Any, ids: list[uuid.UUID]) -> list[dict[str, Any]]:
    async with svc.engine.connect() as conn:
        result = await conn.execute(text("SELECT * FROM tasks WHERE id = ANY(:ids)"), {"ids": ids})
        return [dict(r) for r in result.mappings().all()]


async def wait_all(
    svc: Any, ids: list[uuid.UUID], statuses: tuple[str, ...], within: float
) -> list[dict[str, Any]]:
    async def reached() -> list[dict[str, Any]] | None:
        try:
            got = await rows(svc, ids)
        except Exception:  # the database may still be coming back
            return None
        return got if len(got) == len(ids) and all(r["status"] in statuses for r in got) else None

    return await wait_for(reached, within=within, interval=0.1, what=f"{len(ids)} tasks to reach {statuses}")


async def handlers_running(svc: Any, ids: list[uuid.UUID]) -> None:
    async def started() -> bool:
        async with svc.engine.connect() as conn:
            n = (
                await conn.execute(
                    text(
                        """SELECT count(*) FROM diagnostics_runs
                        WHERE task_id = ANY(:ids) AND status = 'running'"""
                    ),
                    {"ids": ids},
                )
            ).scalar_one()
        return n == len(ids)

    await wait_for(started, within=45, what="every handler to start")


async def test_a_one_second_postgres_restart_fails_no_running_task(
    cluster: Cluster, owned: Owned, svc: Any, record_property: Any
) -> None:
    env = owned.env(DTASK_LEASE_SECONDS="6")  # heartbeat every 2 s; the restart fits the lease
    worker = cluster.start_worker(concurrency=6, **env)
    cluster.start_beat(**env)
    await cluster.wait_worker_ready(worker, broker=owned.broker_url)
    ids = [
        (await Submitter(svc).submit(TaskIntent("diagnostics.sleep", {"seconds": 10, "steps": 20}))).task_id
        for _ in range(4)
    ]
    await handlers_running(svc, ids)
    await svc.engine.dispose()  # our own pooled connections die with the server
    down = await asyncio.to_thread(outage.restart_postgres, owned.pg, 1.0)
    done = await wait_all(svc, ids, ("success", "failed", "cancelled"), within=60)
    record_property("postgres_down_seconds", round(down, 2))
    print(f"PostgreSQL was down {down:.2f} s")
    assert all(r["status"] == "success" and r["attempt_count"] == 1 for r in done), [
        (r["status"], r["error"], r["attempt_count"]) for r in done
    ]
    assert "retrying" in worker.log_text()  # it did meet the outage


async def test_postgres_paused_past_the_lease_fails_tasks_and_rejects_late_writes(
    cluster: Cluster, owned: Owned, svc: Any
) -> None:
    lease = 3.0
    env = owned.env(DTASK_LEASE_SECONDS=str(lease))
    worker = cluster.start_worker(concurrency=6, **env)
    cluster.start_beat(**env)
    await cluster.wait_worker_ready(worker, broker=owned.broker_url)
    ids = [
        (
            await Submitter(svc).submit(
                TaskIntent("diagnostics.sleep", {"seconds": 30, "steps": 60, "effects": True})
            )
        ).task_id
        for _ in range(2)
    ]
    await handlers_running(svc, ids)
    await svc.engine.dispose()
    pid = outage.pause_postgres(owned.pg)
    try:
        await asyncio.sleep(lease + 3)
    finally:
        outage.resume(pid)
    resumed = time.monotonic()
    done = await wait_all(svc, ids, ("success", "failed", "cancelled"), within=60)
    after = time.monotonic() - resumed
    print(f"paused {lease + 3:.0f} s (lease {lease:.0f} s): tasks terminal {after:.2f} s after the resume")
    assert all(r["status"] == "failed" and r["error"]["code"] == "lease_expired" for r in done), done
    async with svc.engine.connect() as conn:
        late = (
            await conn.execute(
                text(
                    """SELECT count(*) FROM diagnostics_effects e
                    JOIN task_attempts a ON a.token = e.attempt_token
                    WHERE e.task_id = ANY(:ids) AND e.created_at > a.ended_at"""
                ),
                {"ids": ids},
            )
        ).scalar_one()
    assert late == 0  # nothing the paused-out owners wrote after their lease was committed

    async def rejected() -> bool:
        log = worker.log_text()
        return "no renewal reached the database within the lease" in log or "lease lost" in log

    await wait_for(rejected, within=15, what="the worker to give up its attempts")


# ------------------------------------------------------------------ the api through outages

ROUTES = [
    ("GET", "/healthz", None),
    ("GET", "/readyz", None),
    ("GET", "/tasks", None),
    ("GET", "/tasks/summary", None),
    ("GET", f"/tasks/{uuid.uuid4()}", None),
    ("GET", "/task-types", None),
    ("GET", "/metrics", None),
    ("POST", "/tasks", {"task_type": "diagnostics.noop"}),
    ("POST", "/tasks/batch", {"tasks": [{"task_type": "diagnostics.noop"}]}),
    ("POST", f"/tasks/{uuid.uuid4()}/cancel", None),
    ("DELETE", f"/tasks/{uuid.uuid4()}", None),
]
BOUND = 2.5  # seconds: the promised bound (2 s) plus slack, for every route with a dependency down


@pytest.fixture
def api(owned: Owned, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("DTASK_")},
        **owned.env(DTASK_API_KEYS=f"ops:{KEY}:admin", DTASK_METRICS_CACHE_SECONDS="0"),
        "PYTHONPATH": str(ROOT),
    }
    log = (tmp_path / "api.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tasks_core.ops.cli", "api", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "api.log").read_text()
        time.sleep(0.1)
    yield base
    proc.send_signal(signal.SIGTERM)
    proc.wait(10)


Answer = tuple[int, float, str | None]  # status, seconds, Retry-After


def call_every_route(base: str) -> dict[str, Answer]:
    answers = {}
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=10) as client:
        for method, path, body in ROUTES:
            started = time.monotonic()
            r = client.request(method, path, json=body)
            answers[f"{method} {path}"] = (
                r.status_code, time.monotonic() - started, r.headers.get("Retry-After")
            )
    return answers


def assert_answered(answers: dict[str, Answer], allowed: set[int]) -> None:
    print("slowest answer: {:.2f} s ({})".format(*max((a[1], r) for r, a in answers.items())))
    slow = {route: a for route, a in answers.items() if a[1] > BOUND}
    assert not slow, f"routes slower than {BOUND} s: {slow}"
    # Routes that need neither dependency just answer.
    needless = ("GET /healthz", "GET /task-types")
    bad = {route: a for route, a in answers.items() if a[0] not in allowed and route not in needless}
    assert not bad, f"unexpected answers: {bad}"
    assert answers["GET /healthz"][0] == 200
    # A client told "unavailable" is also told when to come back (/readyz is a probe's verdict).
    unhinted = {r: a for r, a in answers.items() if a[0] == 503 and not a[2] and r != "GET /readyz"}
    assert not unhinted, f"503 without Retry-After: {unhinted}"


@pytest.mark.parametrize("outage_kind", ["stopped", "paused"])
async def test_with_postgres_down_every_route_answers_503_in_time(
    owned: Owned, api: str, outage_kind: str, record_property: Any
) -> None:
    if outage_kind == "stopped":
        await asyncio.to_thread(outage.crash_postgres, owned.pg)
        pid = None
    else:
        pid = outage.pause_postgres(owned.pg)
    try:
        answers = await asyncio.to_thread(call_every_route, api)
    finally:
        if pid is not None:
            outage.resume(pid)
        else:
            await asyncio.to_thread(owned.pg.start)
    record_property("answers", answers)
    # 503 names the missing dependency; 404 for an unknown id is fine only if answered.
    assert_answered(answers, {503, 404})
    assert answers["GET /readyz"][0] == 503

    # Back up: the api serves again without a restart.
    async def healthy() -> bool:
        r = await asyncio.to_thread(httpx.get, f"{api}/tasks", headers={"Authorization": f"Bearer {KEY}"})
        return r.status_code == 200

    await wait_for(healthy, within=30, what="the api to serve again")


async def test_after_a_postgres_restart_no_request_meets_a_dead_pooled_connection(
    owned: Owned, api: str
) -> None:
    """The api checks out pooled connections without a round trip; one whose server went away is
    still never handed to a request."""
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"task_type": "diagnostics.noop"}

    def burst() -> list[int]:  # enough at once that the pool holds several connections
        with httpx.Client(base_url=api, headers=headers, timeout=10) as client:
            return [client.post("/tasks", json=body).status_code for _ in range(3)] + [
                client.get("/tasks").status_code for _ in range(3)]

    before = await asyncio.gather(*(asyncio.to_thread(burst) for _ in range(8)))
    assert {s for statuses in before for s in statuses} == {200, 202}
    await asyncio.to_thread(outage.restart_postgres, owned.pg, 0.5)
    after = await asyncio.gather(*(asyncio.to_thread(burst) for _ in range(8)))
    assert {s for statuses in after for s in statuses} == {200, 202}, after


async def test_with_redis_paused_submissions_stay_pending_and_run_after_recovery(
    cluster: Cluster, owned: Owned, api: str, svc: Any
) -> None:
    redis_pid = outage_redis_pid(owned)
    os.kill(redis_pid, signal.SIGSTOP)
    try:
        answers = await asyncio.to_thread(call_every_route, api)
        # A client that gives up before the (slow) publish: the task is committed; a retry with the
        # same Idempotency-Key gets it back instead of creating a second one.
        key = {"Authorization": f"Bearer {KEY}", "Idempotency-Key": "retry-me"}
        body = {"task_type": "diagnostics.noop", "payload": {"once": True}}
        with pytest.raises(httpx.TimeoutException):
            await asyncio.to_thread(httpx.post, f"{api}/tasks", json=body, headers=key, timeout=0.3)
    finally:
        os.kill(redis_pid, signal.SIGCONT)
    assert_answered(answers, {200, 202, 503, 404})
    assert answers["POST /tasks"][0] == 202 and answers["POST /tasks/batch"][0] == 202
    retried = await asyncio.to_thread(httpx.post, f"{api}/tasks", json=body, headers=key, timeout=10)
    assert retried.status_code == 200, retried.text
    async with svc.engine.connect() as conn:
        same = (
            await conn.execute(text("SELECT count(*) FROM tasks WHERE payload = '{\"once\": true}'::jsonb"))
        ).scalar_one()
    assert same == 1
    pending = [t["id"] for t in (await svc.repo.list(status="pending", limit=50))[0]]
    assert pending
    # Workers and beat come up after the outage: the publisher sends what the submit could not.
    worker = cluster.start_worker(concurrency=3, **owned.env())
    cluster.start_beat(**owned.env())
    await cluster.wait_worker_ready(worker, broker=owned.broker_url)
    await wait_all(svc, pending, ("success",), within=45)


def outage_redis_pid(owned: Owned) -> int:
    from tasks_core.devkit.embedded import _redis_server_pid

    parts = urlsplit(owned.broker_url)
    assert parts.port is not None
    pid = _redis_server_pid(parts.port, parts.password)
    assert pid is not None
    return pid
