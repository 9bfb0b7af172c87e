"""Test services: a temporary database (random name, dropped after) on the machine's PostgreSQL
and a Redis DB index of our own; embedded servers from wheels when no server answers.

Everything is decided in pytest_configure, before any test module imports the Celery app, so
celeryconfig reads the test broker from the environment.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_sync

ROOT = Path(__file__).resolve().parent.parent
_cleanup: list[Any] = []


def pytest_configure(config: pytest.Config) -> None:
    from tasks_core.devkit.embedded import EmbeddedPostgres, EmbeddedRedis, create_database, reachable

    admin = os.environ.get("DTASK_TEST_ADMIN_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres")
    redis_base = os.environ.get("DTASK_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    scratch = Path(tempfile.mkdtemp(prefix="dtask-test-"))
    if not reachable(admin):
        pg = EmbeddedPostgres(scratch / "pg")
        admin = pg.start()
        _cleanup.append(pg.destroy)  # as root its cluster is outside scratch
    if not reachable(redis_base):
        rd = EmbeddedRedis(scratch / "redis")
        redis_base = rd.start()
        _cleanup.append(rd.stop)
    name = f"dtask_test_{uuid.uuid4().hex[:12]}"
    db_url = create_database(admin, name)
    _cleanup.insert(0, lambda: _drop(admin, name))
    # Our own DB index (1-15, never 0 which the machine's own users default to); under
    # `pytest -n N` each worker process (gw0, gw1, ...) takes the next one.
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    offset = int(worker[2:]) if worker.startswith("gw") else 0
    index = (int(os.environ.get("DTASK_TEST_REDIS_DB", random.randint(1, 15))) + offset - 1) % 15 + 1
    broker = redis_base.rsplit("/", 1)[0] + f"/{index}"
    redis_sync.Redis.from_url(broker).flushdb()
    os.environ.update(
        DTASK_DATABASE_URL=db_url,
        DTASK_BROKER_URL=broker,
        DTASK_REDIS_URL=broker,
        DTASK_TEST_ADMIN_URL=admin,
        DTASK_TEST_SCRATCH=str(scratch),
    )
    os.environ.pop("DTASK_CAPACITY", None)

    from alembic import command

    from tasks_core.db import alembic_config

    command.upgrade(alembic_config(db_url), "head")


def _drop(admin: str, name: str) -> None:
    from tasks_core.devkit.embedded import drop_database

    drop_database(admin, name)


def pytest_unconfigure(config: pytest.Config) -> None:
    broker = os.environ.get("DTASK_BROKER_URL")
    if broker:
        with contextlib.suppress(redis_sync.RedisError):
            redis_sync.Redis.from_url(broker).flushdb()
    for fn in _cleanup:
        try:
            fn()
        except Exception as exc:  # keep cleaning the rest
            print(f"cleanup failed: {exc!r}")


@pytest.fixture(scope="session")
def database_url() -> str:
    return os.environ["DTASK_DATABASE_URL"]


@pytest.fixture(scope="session")
def broker_url() -> str:
    return os.environ["DTASK_BROKER_URL"]


@pytest.fixture
def redis_client(broker_url: str) -> Iterator[redis_sync.Redis]:
    client = redis_sync.Redis.from_url(broker_url)
    yield client
    client.close()


# Every table a test may write; emptied before each test that asks for a clean database.
TABLES = (
    "tasks", "task_attempts", "task_slots", "diagnostics_runs", "diagnostics_effects", "idempotency_keys",
    "knowledge_bases", "knowledge_files", "knowledge_chunks",
    "evaluation_datasets", "evaluation_items", "evaluation_runs", "evaluation_run_items",
    "graph_builds", "graph_entities", "graph_edges", "ui_sessions", "schedules", "schedule_runs",
    "paused_types",
)


@pytest.fixture
async def clean_db(database_url: str, redis_client: redis_sync.Redis) -> AsyncIterator[None]:
    from sqlalchemy import text

    from tasks_core.db import make_engine

    redis_client.flushdb()
    engine = make_engine(database_url, pool_size=1)
    async with engine.begin() as conn:
        await conn.execute(text(f"TRUNCATE {', '.join(TABLES)} CASCADE"))
    await engine.dispose()
    yield


def make_settings(**overrides: Any) -> Any:
    from tasks_core.settings import Settings

    base: dict[str, Any] = {
        "database_url": os.environ["DTASK_DATABASE_URL"],
        "broker_url": os.environ["DTASK_BROKER_URL"],
        "lease_seconds": 3.0,
        "reconcile_seconds": 1.0,
        "publish_seconds": 2.0,
        "shutdown_grace_seconds": 1.0,
    }
    base.update(overrides)
    return Settings(**base)


@pytest.fixture
def settings_factory() -> Any:
    return make_settings


@pytest.fixture
async def services(clean_db: None) -> AsyncIterator[Any]:
    from tasks_core.services import build_services

    svc = build_services(make_settings(), pool_size=10)
    yield svc
    await svc.close()


@pytest.fixture(scope="session")
def knowledge_stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real Milvus (milvus-lite server) and a real S3 (SeaweedFS), started once, only for the
    tests that ask. Their DTASK_* settings are exported, so in-process settings and spawned workers
    (pass the returned dict to ``cluster.start_worker(**env)``) reach them; stopped at session end."""
    from concurrent.futures import ThreadPoolExecutor

    from tasks_core.devkit.embedded_stores import EmbeddedMilvus, EmbeddedS3

    root = tmp_path_factory.mktemp("knowledge-stores")
    milvus, s3 = EmbeddedMilvus(root / "milvus"), EmbeddedS3(root / "s3")
    with ThreadPoolExecutor(2) as pool:  # both start in about a second; no need to wait twice
        uri_future, s3_future = pool.submit(milvus.start), pool.submit(s3.start)
        try:
            uri, endpoint = uri_future.result(), s3_future.result()
        except BaseException:
            milvus.stop()
            s3.stop()
            raise
    env = {"DTASK_MILVUS_URI": uri, **endpoint.env(), "DTASK_MINIO_BUCKET": "dtask-test"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        milvus.stop()
        s3.stop()


@pytest.fixture(scope="session")
def faulty_stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A Milvus and an S3 of their own for the tests that pause, kill and restart them (the shared
    ``knowledge_stores`` are never touched); started once, on first use."""
    from tests.store_faults import FaultyStores

    stores = FaultyStores(tmp_path_factory.mktemp("faulty-stores"))
    try:
        stores.start()
        yield stores
    finally:
        stores.stop()
