"""After `dtask migrate` upgraded a pre-durable (0.7.2) database, a real `celery worker` + beat
converge every legacy task through the current hooks; no file stays in progress; instants kept."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from tests.migration.legacy_fixture import (
    LEGACY_CREATED,
    TASK_IDS,
    build_0_7_2,
    run,
    scratch_database,
    utc,
)
from tests.system.conftest import Cluster, wait_for

LEGACY_ACTIVE = ("pending", "pending_cancel", "running", "running_cancel", "running_unknown")


@pytest.fixture
def legacy_db() -> Iterator[str]:
    with scratch_database("dtask_legacy_sys") as url:
        build_0_7_2(url)
        yield url


async def query(url: str, sql: str) -> list[Any]:
    return await asyncio.to_thread(run, url, sql)


async def _legacy_rows(url: str) -> dict[str, dict[str, Any]]:
    by_id = {r["id"].hex: r for r in await query(url, "SELECT * FROM tasks")}
    return {name: by_id[TASK_IDS[name]] for name in TASK_IDS}


async def test_a_worker_and_beat_converge_the_legacy_tasks_after_the_upgrade(
    legacy_db: str, cluster: Cluster
) -> None:
    # legacy_db first: the cluster's processes stop before their database is dropped.
    env = {"DTASK_DATABASE_URL": legacy_db}
    migrated = cluster.run_cli("migrate", **env)
    assert migrated.returncode == 0, migrated.stderr
    assert "found: pre-durable" in migrated.stdout
    status = cluster.run_cli("db-status", **env)
    assert status.returncode == 0 and "legacy tasks to converge: 5 (2 pending, 3 running)" in status.stdout

    worker = cluster.start_worker(**env)
    cluster.start_beat(**env)
    await cluster.wait_worker_ready(worker)

    async def converged() -> dict[str, dict[str, Any]] | None:
        rows = await _legacy_rows(legacy_db)
        return rows if all(rows[n]["status"] in ("failed", "cancelled") for n in LEGACY_ACTIVE) else None

    rows = await wait_for(converged, within=60, interval=0.5, what="the legacy tasks to converge")

    expected = {
        "pending": ("failed", "legacy_interrupted"),
        "running": ("failed", "legacy_interrupted"),
        "pending_cancel": ("cancelled", "cancelled"),
        "running_cancel": ("cancelled", "cancelled"),  # knowledge.ingest: its own failure hook
        "running_unknown": ("failed", "handler_unavailable"),  # no such type any more: fail closed
        "success": ("success", None),
        "failed": ("failed", "legacy_error"),
        "cancelled": ("cancelled", None),
    }
    for name, (want, code) in expected.items():
        row = rows[name]
        assert (row["status"], (row["error"] or {}).get("code")) == (want, code), name
        assert row["created_at"] == utc(LEGACY_CREATED[name]), name  # the same instant as in 0.7.2
    # The current diagnostics failure hook ran in the worker for the diagnostics tasks it converged.
    hooks = {
        r["task_id"].hex: (r["status"], r["hook"])
        for r in await query(legacy_db, "SELECT * FROM diagnostics_runs")
    }
    assert hooks == {
        TASK_IDS["pending"]: ("failed", "failure:failed"),
        TASK_IDS["running"]: ("failed", "failure:failed"),
        TASK_IDS["pending_cancel"]: ("cancelled", "failure:cancelled"),
    }
    files = await query(
        legacy_db, "SELECT status FROM knowledge_files WHERE status IN ('parsing', 'parsed', 'indexing')"
    )
    assert files == []
    errors = await query(legacy_db, "SELECT count(*) AS n FROM knowledge_files WHERE status LIKE 'error_%'")
    assert errors[0]["n"] == 5  # three interrupted, two that had failed before
    status = cluster.run_cli("db-status", **env)
    assert status.returncode == 0 and "legacy tasks to converge: 0" in status.stdout
