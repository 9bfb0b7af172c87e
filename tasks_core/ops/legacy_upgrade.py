"""The in-place upgrade from the pre-durable release (0.7.2), in the caller's transaction.

The 0.7.2 tables move to the archive schema untouched (what does not fit our columns, such as a
task's name and updated_at, stays readable there); Alembic then builds the current tables and the
rows are copied across:

- every task keeps its id (the uuid4 hex becomes the same UUID), ``type`` becomes ``task_type``,
  statuses are the same words; every row gets ``handler_version = 0`` (legacy), so the reconciler
  converges the non-terminal ones through the current type's failure hook. A legacy ``running`` row
  gets a placeholder attempt token nobody holds and a lease that is already over (the running-owner
  CHECK needs both); no attempt row and no capacity slot: no attempt of ours ever ran it.
- ``cancel_requested = 1`` becomes cancel intent, ``error`` text the structured error, and naive
  UTC timestamps ``timestamptz`` at the same instants.
- knowledge files gain the owner columns (empty: no attempt owns them); those left ``parsing``,
  ``parsed`` or ``indexing`` by a process that is gone become ``error_parsing`` / ``error_indexing``
  saying so. Bases that existed only as ``kb_id`` values get rows (owner ``legacy``; their embedder
  is unknown).

Names the knowledge tables of 0.7.2 as a historical fact; imports nothing of the domain.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.engine import Connection

from tasks_core.model import LEGACY_VERSION
from tasks_core.ops.schema_detect import ARCHIVE_SCHEMA, MigrationRefused

A = ARCHIVE_SCHEMA
LEGACY_OWNER = "legacy"
INTERRUPTED = (
    "the service was interrupted while this file was {status} (upgrade from the pre-durable release); "
    "reindex to retry"
)
_TASK_STATUSES = "('pending', 'running', 'success', 'failed', 'cancelled')"
_FILE_STATUSES = "('uploaded', 'parsing', 'parsed', 'indexing', 'indexed', 'error_parsing', 'error_indexing')"


class LegacyDataRefused(MigrationRefused):
    """0.7.2 rows that cannot be carried over as they are; nothing was changed."""


def _count(conn: Connection, sql: str) -> int:
    return int(conn.execute(text(sql)).scalar() or 0)


def check(conn: Connection, has_files: bool) -> None:
    """Refuse, before any DDL, rows the current schema could not hold (with what and how many)."""
    problems = []
    bad_ids = _count(conn, "SELECT count(*) FROM tasks WHERE id !~* '^[0-9a-f]{32}$'")
    if bad_ids:
        problems.append(f"{bad_ids} task id(s) are not uuid4 hex")
    bad_status = _count(
        conn, f"SELECT count(*) FROM tasks WHERE status IS NULL OR status NOT IN {_TASK_STATUSES}"
    )
    if bad_status:
        problems.append(f"{bad_status} task(s) with an unknown status")
    if _count(conn, "SELECT count(*) FROM tasks WHERE type IS NULL"):
        problems.append("tasks with no type")
    if has_files:
        bad_files = _count(
            conn,
            f"""SELECT count(*) FROM knowledge_files WHERE status IS NULL OR status NOT IN {_FILE_STATUSES}
                OR file_type NOT IN ('txt', 'md', 'html', 'pdf') OR kb_id IS NULL OR length(kb_id) > 64""",
        )
        if bad_files:
            problems.append(f"{bad_files} knowledge file(s) with an unknown status, file type or kb_id")
    if problems:
        raise LegacyDataRefused("pre-durable data this release cannot hold: " + "; ".join(problems))


def archive(conn: Connection, has_files: bool) -> None:
    conn.execute(text(f"CREATE SCHEMA {A}"))
    for table in ("tasks", "knowledge_files") if has_files else ("tasks",):
        conn.execute(text(f"ALTER TABLE {table} SET SCHEMA {A}"))


def copy_tasks(conn: Connection, timeout_seconds: float) -> int:
    """Copy the archived tasks into the current table; returns how many."""
    result = conn.execute(
        text(
            f"""INSERT INTO tasks (id, task_type, handler_version, payload, owner, status, attempt_token,
                   lease_expires_at, cancel_requested_at, timeout_seconds, progress, message, result,
                   error, created_at, started_at, finished_at)
            SELECT CAST(t.id AS uuid), t.type, {LEGACY_VERSION}, coalesce(CAST(t.payload AS jsonb), '{{}}'),
                   NULL, t.status,
                   CASE WHEN t.status = 'running' THEN gen_random_uuid() END,
                   CASE WHEN t.status = 'running' THEN clock_timestamp() END,
                   CASE WHEN coalesce(t.cancel_requested, 0) <> 0
                        THEN coalesce(t.updated_at, t.created_at, timezone('UTC', clock_timestamp()))
                             AT TIME ZONE 'UTC' END,
                   :timeout,
                   CASE WHEN t.progress IS NULL OR t.progress = 'NaN' THEN 0
                        ELSE least(greatest(t.progress, 0), 100) END,
                   t.message, CAST(t.result AS jsonb),
                   CASE WHEN t.error IS NOT NULL
                        THEN jsonb_build_object('code', 'legacy_error', 'message', t.error) END,
                   coalesce(t.created_at, t.updated_at, timezone('UTC', clock_timestamp()))
                       AT TIME ZONE 'UTC',
                   t.started_at AT TIME ZONE 'UTC',
                   CASE WHEN t.status IN ('success', 'failed', 'cancelled')
                        THEN coalesce(t.completed_at, t.updated_at, t.created_at) AT TIME ZONE 'UTC' END
            FROM {A}.tasks t"""
        ),
        {"timeout": timeout_seconds},
    )
    return result.rowcount


def copy_knowledge(conn: Connection) -> tuple[int, int]:
    """Base rows from the kb_id values, then the files; returns (bases, files)."""
    bases = conn.execute(
        text(
            f"""INSERT INTO knowledge_bases (id, owner, name, embedder, dimension, created_at)
            SELECT kb_id, :owner, kb_id, 'unknown (pre-durable)', 0,
                   coalesce(min(created_at), timezone('UTC', clock_timestamp())) AT TIME ZONE 'UTC'
            FROM {A}.knowledge_files GROUP BY kb_id"""
        ),
        {"owner": LEGACY_OWNER},
    ).rowcount
    files = conn.execute(
        text(
            f"""INSERT INTO knowledge_files (file_id, kb_id, filename, file_type, status, error_message,
                   chunk_count, created_at, updated_at)
            SELECT f.file_id, f.kb_id, f.filename, f.file_type,
                   CASE f.status WHEN 'parsing' THEN 'error_parsing'
                                 WHEN 'parsed' THEN 'error_indexing'
                                 WHEN 'indexing' THEN 'error_indexing' ELSE f.status END,
                   CASE WHEN f.status IN ('parsing', 'parsed', 'indexing')
                        THEN replace(:interrupted, '{{status}}', f.status) ELSE f.error_message END,
                   coalesce(f.chunk_count, 0),
                   coalesce(f.created_at, timezone('UTC', clock_timestamp())) AT TIME ZONE 'UTC',
                   coalesce(f.updated_at, f.created_at, timezone('UTC', clock_timestamp())) AT TIME ZONE 'UTC'
            FROM {A}.knowledge_files f"""
        ),
        {"interrupted": INTERRUPTED},
    ).rowcount
    return bases, files
