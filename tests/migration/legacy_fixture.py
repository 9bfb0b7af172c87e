"""The pre-durable release's (0.7.2) schema exactly, with rows in every state, and database helpers.

Timestamps are naive UTC, as 0.7.2 wrote them; ``LEGACY_CREATED`` lets tests check that the
upgrade keeps each instant.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import text

from tasks_core.db import make_engine
from tasks_core.devkit.embedded import create_database, drop_database
from tasks_core.ops.schema_detect import ARCHIVE_SCHEMA

SCHEMA_0_7_2 = """
CREATE TABLE tasks (
    id varchar(32) PRIMARY KEY,
    name varchar(255),
    type varchar(64) NOT NULL,
    status varchar(32) NOT NULL DEFAULT 'pending',
    progress double precision DEFAULT 0,
    message text,
    payload json,
    result json,
    error text,
    cancel_requested integer DEFAULT 0,
    created_at timestamp without time zone,
    updated_at timestamp without time zone,
    started_at timestamp without time zone,
    completed_at timestamp without time zone
);
CREATE INDEX ix_tasks_status ON tasks (status);
CREATE TABLE knowledge_files (
    file_id varchar(64) NOT NULL UNIQUE,
    kb_id varchar(64) NOT NULL,
    filename varchar(255) NOT NULL,
    file_type varchar(16) NOT NULL,
    status varchar(32) NOT NULL DEFAULT 'uploaded',
    error_message text,
    chunk_count integer DEFAULT 0,
    created_at timestamp without time zone,
    updated_at timestamp without time zone
);
"""

BASE = datetime(2026, 3, 29, 1, 30)  # naive UTC (a DST night in Europe: instants must not shift)
# name -> (type, status, cancel_requested, error)
TASKS: dict[str, tuple[str, str, int, str | None]] = {
    "pending": ("diagnostics.sleep", "pending", 0, None),
    "pending_cancel": ("diagnostics.sleep", "pending", 1, None),
    "running": ("diagnostics.sleep", "running", 0, None),
    "running_cancel": ("knowledge.ingest", "running", 1, None),
    "running_unknown": ("reports.render", "running", 0, None),
    "success": ("diagnostics.noop", "success", 0, None),
    "failed": ("diagnostics.fail", "failed", 0, "ValueError: boom"),
    "cancelled": ("diagnostics.sleep", "cancelled", 1, None),
}
TASK_IDS = {name: uuid.UUID(int=i + 1).hex for i, name in enumerate(TASKS)}
LEGACY_CREATED = {name: BASE + timedelta(minutes=i) for i, name in enumerate(TASKS)}
FILES = {
    status: f"f-{status}"
    for status in ("uploaded", "parsing", "parsed", "indexing", "indexed", "error_parsing", "error_indexing")
}


@contextmanager
def scratch_database(prefix: str = "dtask_up") -> Iterator[str]:
    """A temporary database of its own (dropped after), on the test run's PostgreSQL."""
    admin = os.environ["DTASK_TEST_ADMIN_URL"]
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    url = create_database(admin, name)
    try:
        yield url
    finally:
        drop_database(admin, name)


def run(url: str, sql: str, params: dict[str, Any] | None = None) -> list[Any]:
    async def go() -> list[Any]:
        engine = make_engine(url, pool_size=1)
        try:
            async with engine.begin() as conn:
                result = await conn.execute(text(sql), params or {})
                return list(result.mappings()) if result.returns_rows else []
        finally:
            await engine.dispose()

    return asyncio.run(go())


def reset(url: str) -> None:
    """Empty the database: no table, no archive schema, no version record."""

    async def go() -> None:
        engine = make_engine(url, pool_size=1)
        try:
            async with engine.begin() as conn:
                await conn.execute(text(f"DROP SCHEMA IF EXISTS {ARCHIVE_SCHEMA} CASCADE"))
                await conn.execute(text("DROP SCHEMA public CASCADE"))
                await conn.execute(text("CREATE SCHEMA public"))
        finally:
            await engine.dispose()

    asyncio.run(go())


def build_0_7_2(url: str) -> None:
    """The 0.7.2 tables with a task in every state and a file in every state (two bases)."""

    async def go() -> None:
        engine = make_engine(url, pool_size=1)
        try:
            async with engine.begin() as conn:
                for stmt in filter(str.strip, SCHEMA_0_7_2.split(";")):
                    await conn.execute(text(stmt))
                for name, (task_type, status, cancel, error) in TASKS.items():
                    created = LEGACY_CREATED[name]
                    started = created + timedelta(seconds=5) if status != "pending" else None
                    done = (
                        created + timedelta(seconds=9)
                        if status in ("success", "failed", "cancelled")
                        else None
                    )
                    await conn.execute(
                        text(
                            """INSERT INTO tasks VALUES (:id, :name, :type, :status, :progress, :message,
                            CAST(:payload AS json), CAST(:result AS json), :error, :cancel, :created,
                            :updated, :started, :done)"""
                        ),
                        {
                            "id": TASK_IDS[name],
                            "name": f"legacy {name}",
                            "type": task_type,
                            "status": status,
                            "progress": 100.0 if status == "success" else 40.0,
                            "message": f"was {status}",
                            "payload": '{"seconds": 1}',
                            "result": '{"ok": true}' if status == "success" else None,
                            "error": error,
                            "cancel": cancel,
                            "created": created,
                            "updated": created + timedelta(seconds=7),
                            "started": started,
                            "done": done,
                        },
                    )
                for i, (status, file_id) in enumerate(FILES.items()):
                    await conn.execute(
                        text(
                            """INSERT INTO knowledge_files VALUES (:id, :kb, :fn, 'txt', :status, :err,
                            :chunks, :created, :created)"""
                        ),
                        {
                            "id": file_id,
                            "kb": "kb-a" if i % 2 else "kb-b",
                            "fn": f"{status}.txt",
                            "status": status,
                            "err": "old failure" if status.startswith("error") else None,
                            "chunks": 3 if status == "indexed" else 0,
                            "created": BASE + timedelta(hours=i),
                        },
                    )
        finally:
            await engine.dispose()

    asyncio.run(go())


def utc(naive: datetime) -> datetime:
    return naive.replace(tzinfo=UTC)


def snapshot(url: str) -> dict[str, Any]:
    """Everything a migration could change: schemas, columns, indexes, constraints and every row."""
    catalog = run(
        url,
        """SELECT 'col' AS k, table_schema || '.' || table_name || '.' || column_name || ' ' || data_type AS v
           FROM information_schema.columns WHERE table_schema NOT IN ('pg_catalog', 'information_schema')
           UNION ALL SELECT 'idx', schemaname || '.' || indexdef FROM pg_indexes
           WHERE schemaname NOT IN ('pg_catalog', 'information_schema')
           UNION ALL SELECT 'con', conrelid::regclass::text || ' ' || pg_get_constraintdef(oid)
           FROM pg_constraint
           WHERE connamespace NOT IN ('pg_catalog'::regnamespace, 'information_schema'::regnamespace)
           UNION ALL SELECT 'nsp', nspname FROM pg_namespace WHERE nspname NOT LIKE 'pg\\_%'""",
    )
    tables = run(
        url,
        """SELECT table_schema || '.' || table_name AS t FROM information_schema.tables
           WHERE table_schema NOT IN ('pg_catalog', 'information_schema') AND table_type = 'BASE TABLE'""",
    )
    rows = {t["t"]: sorted(r["v"] for r in run(url, f"SELECT x::text AS v FROM {t['t']} x")) for t in tables}
    return {"catalog": sorted((c["k"], c["v"]) for c in catalog), "rows": rows}
