"""`dtask migrate` from each starting point (twice), the refused ones, failed steps and two at once."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from alembic import command

from tasks_core.db import alembic_config, head_revision
from tasks_core.ops.legacy_upgrade import LEGACY_OWNER
from tasks_core.ops.schema_detect import ARCHIVE_SCHEMA, MigrationRefused
from tasks_core.ops.schema_upgrade import MIGRATE_LOCK_KEY, Outcome, detect, upgrade_database
from tests.migration.legacy_fixture import (
    FILES,
    LEGACY_CREATED,
    TASK_IDS,
    TASKS,
    build_0_7_2,
    reset,
    run,
    scratch_database,
    snapshot,
    utc,
)
from tests.migration.test_migrations import _diff

ROOT = str(Path(__file__).resolve().parents[2])


@pytest.fixture(scope="module")
def shared_db() -> Iterator[str]:
    with scratch_database() as url:
        yield url


@pytest.fixture
def db(shared_db: str) -> str:
    """An empty database: the module's own, emptied (cheaper than a new database per test)."""
    reset(shared_db)
    return shared_db


def migrate(url: str, after_step: Callable[[str], None] | None = None) -> Outcome:
    return asyncio.run(upgrade_database(url, timeout_seconds=600, after_step=after_step))


def _twice(url: str, kind: str) -> Outcome:
    first = migrate(url)
    assert (first.found.kind, first.applied) == (kind, True)
    again = migrate(url)
    assert (again.found.kind, again.applied, again.found.revision) == ("current", False, head_revision())
    assert _diff(url) == []  # models and migrations agree
    return first


def test_empty_database_gets_the_current_schema(db: str) -> None:
    _twice(db, "empty")


def test_older_alembic_database_is_upgraded_to_head(db: str) -> None:
    command.upgrade(alembic_config(db), "0002")
    run(
        db,
        "INSERT INTO tasks (id, task_type, handler_version, timeout_seconds) VALUES (:id, 'x', 1, 5)",
        {"id": uuid.uuid4()},
    )
    assert asyncio.run(detect(db)).revision == "0002"
    _twice(db, "older")
    assert len(run(db, "SELECT * FROM tasks")) == 1


def test_pre_durable_database_is_upgraded_in_place(db: str) -> None:
    build_0_7_2(db)
    first = _twice(db, "pre_durable")
    assert first.counts == {"tasks": len(TASKS), "bases": 2, "files": len(FILES)}

    rows = {r["id"].hex: r for r in run(db, "SELECT * FROM tasks")}
    assert set(rows) == set(TASK_IDS.values())  # every row, same id (hex -> the same UUID)
    for name, (task_type, status, cancel, error) in TASKS.items():
        row = rows[TASK_IDS[name]]
        assert (row["task_type"], row["status"], row["handler_version"]) == (task_type, status, 0), name
        assert (row["cancel_requested_at"] is not None) == bool(cancel), name
        created = utc(LEGACY_CREATED[name])
        assert row["created_at"] == created, name  # the same instants
        assert row["started_at"] == (None if status == "pending" else created + timedelta(seconds=5))
        terminal = status in ("success", "failed", "cancelled")
        assert row["finished_at"] == (created + timedelta(seconds=9) if terminal else None), name
        assert row["error"] == (None if error is None else {"code": "legacy_error", "message": error})
        assert (row["attempt_token"] is not None) == (status == "running") and row["attempt_count"] == 0
    assert rows[TASK_IDS["success"]]["result"] == {"ok": True}
    assert run(db, "SELECT count(*) AS n FROM task_attempts")[0]["n"] == 0  # no attempt of ours ran them

    files = {f["file_id"]: f for f in run(db, "SELECT * FROM knowledge_files")}
    expected = {"parsing": "error_parsing", "parsed": "error_indexing", "indexing": "error_indexing"}
    for status, file_id in FILES.items():
        f = files[file_id]
        assert f["status"] == expected.get(status, status) and f["task_id"] is None
        if status in expected:
            assert "service was interrupted" in f["error_message"] and status in f["error_message"]
    bases = run(db, "SELECT id, owner, name FROM knowledge_bases ORDER BY id")
    assert [(b["id"], b["owner"], b["name"]) for b in bases] == [
        ("kb-a", LEGACY_OWNER, "kb-a"),
        ("kb-b", LEGACY_OWNER, "kb-b"),
    ]
    # What did not fit our columns stays readable in the archive.
    names = run(db, f"SELECT name FROM {ARCHIVE_SCHEMA}.tasks WHERE id = :id", {"id": TASK_IDS["running"]})
    assert names == [{"name": "legacy running"}]


REFUSALS = {
    "unknown_tables": ("CREATE TABLE users (id int)", "unknown tables and no version record: users"),
    "foreign_tasks_table": ("CREATE TABLE tasks (id int, body text)", "tasks is not the 0.7.2 shape"),
    "legacy_plus_unknown": ("@legacy; CREATE TABLE audit (id int)", "no version record: audit"),
    "future_version": ("@head; UPDATE alembic_version SET version_num = 'z9999'", "'z9999', which this"),
    "empty_version_record": ("@head; DELETE FROM alembic_version", "records no revision"),
    "durable_tables_no_version": ("@head; DROP TABLE alembic_version", "half-applied: tables of this"),
    "archive_without_version": (f"CREATE SCHEMA {ARCHIVE_SCHEMA}", f"schema {ARCHIVE_SCHEMA}"),
    "legacy_shape_half_converted": (
        "@legacy; ALTER TABLE knowledge_files ADD COLUMN task_id uuid",
        "knowledge_files is not the 0.7.2 shape: unexpected task_id",
    ),
    "legacy_rows_that_do_not_fit": (
        "@legacy; UPDATE tasks SET id = 'not-hex' WHERE status = 'success'",
        "1 task id(s) are not uuid4 hex",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_anything_else_is_refused_before_any_ddl(db: str, case: str) -> None:
    setup, message = REFUSALS[case]
    for part in filter(str.strip, setup.split(";")):
        if part.strip() == "@legacy":
            build_0_7_2(db)
        elif part.strip() == "@head":
            command.upgrade(alembic_config(db), "head")
        else:
            run(db, part)
    before = snapshot(db)
    for _ in range(2):
        with pytest.raises(MigrationRefused, match=re.escape(message)):
            migrate(db)
        assert snapshot(db) == before


# The last step proves everything before it rolls back too; "schema" is the first with DDL of ours.
@pytest.mark.parametrize("step", ["schema", "knowledge"])
def test_a_failed_step_changes_nothing_and_the_next_run_succeeds(db: str, step: str) -> None:
    build_0_7_2(db)
    before = snapshot(db)
    seen: list[str] = []

    def fail_at(name: str) -> None:
        seen.append(name)
        if name == step:
            raise RuntimeError(f"injected failure after {name}")

    with pytest.raises(RuntimeError, match="injected failure"):
        migrate(db, after_step=fail_at)
    assert seen[-1] == step
    assert snapshot(db) == before
    _twice(db, "pre_durable")


def _waiting_on_migrate_lock(url: str) -> int:
    # An advisory lock's bigint key is split into classid (high half) and objid (low half).
    rows = run(
        url,
        """SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
           AND classid = :hi AND objid = :lo AND database = (SELECT oid FROM pg_database
                                                              WHERE datname = current_database())""",
        {"hi": MIGRATE_LOCK_KEY >> 32, "lo": MIGRATE_LOCK_KEY & 0xFFFFFFFF},
    )
    return int(rows[0]["n"])


def _spawn_two(env: dict[str, str], cwd: Path) -> list[subprocess.Popen[str]]:
    argv = [sys.executable, "-m", "tasks_core.ops.cli", "migrate"]
    return [
        subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]


def test_two_migrate_processes_at_once_one_applies_the_other_finds_nothing_to_do(
    db: str, tmp_path: Path
) -> None:
    """Both start while a third session holds the lock, so both are surely inside `dtask migrate`
    at once; released, one upgrades and the other, once it gets the lock, finds a current schema."""
    from sqlalchemy import text

    build_0_7_2(db)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTASK_")}
    env.update(DTASK_DATABASE_URL=db, PYTHONPATH=ROOT)

    async def hold_and_release(procs: list[subprocess.Popen[str]]) -> list[subprocess.Popen[str]]:
        from tasks_core.db import make_engine

        engine = make_engine(db, pool_size=1)
        try:
            async with engine.connect() as conn:
                await conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATE_LOCK_KEY})
                procs += await asyncio.to_thread(_spawn_two, env, tmp_path)  # outside the checkout: no .env
                deadline = time.monotonic() + 60
                while await asyncio.to_thread(_waiting_on_migrate_lock, db) < 2:
                    assert time.monotonic() < deadline, "the two migrations never both waited on the lock"
                    assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
                    await asyncio.sleep(0.1)
                await conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATE_LOCK_KEY})
                await conn.commit()
            return procs
        finally:
            await engine.dispose()

    procs: list[subprocess.Popen[str]] = []
    try:
        procs = asyncio.run(hold_and_release(procs))
        outputs = []
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert sorted("found: pre-durable" in out for out in outputs) == [False, True], outputs
    assert sum("found: current (nothing to do)" in out for out in outputs) == 1, outputs
    assert len(run(db, "SELECT id FROM tasks")) == len(TASKS)
    assert _diff(db) == []


def test_the_cli_names_what_it_refused_and_db_status_the_starting_point(
    db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from tasks_core.ops.cli import cli
    from tasks_core.settings import get_settings

    monkeypatch.setenv("DTASK_DATABASE_URL", db)
    get_settings.cache_clear()
    try:
        runner = CliRunner()
        build_0_7_2(db)
        status = runner.invoke(cli, ["db-status"])
        assert status.exit_code == 3 and "starting point: pre-durable release 0.7.2" in status.stdout
        assert "database: no version" in status.stdout and "run `dtask migrate`" in status.stderr

        run(db, "CREATE TABLE audit (id int)")
        refused = runner.invoke(cli, ["migrate"])
        assert refused.exit_code == 3
        assert refused.stderr.strip().splitlines() == [
            "refusing to migrate (nothing was changed): unknown tables and no version record: audit "
            "(migrate handles an empty database, the pre-durable 0.7.2 tables or its own Alembic history)"
        ]
        status = runner.invoke(cli, ["db-status"])
        assert status.exit_code == 3 and "starting point: refused: unknown tables" in status.stdout

        run(db, "DROP TABLE audit")
        assert runner.invoke(cli, ["migrate"]).exit_code == 0
        status = runner.invoke(cli, ["db-status"])
        assert status.exit_code == 0 and "starting point: current" in status.stdout
        assert "legacy tasks to converge: 5 (2 pending, 3 running)" in status.stdout
    finally:
        get_settings.cache_clear()
