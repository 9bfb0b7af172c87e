"""What a database is, decided before `dtask migrate` runs any DDL.

Three starting points are handled: an empty database, the pre-durable release's (0.7.2) tables
with no version record, and our own Alembic history (current or older). Anything else is refused
with what was found: unknown tables, a revision from the future, a half-applied upgrade. Reads
only the current schema (``current_schema()``) and the catalog; changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import Connection

from tasks_core.db import alembic_config

# Where the pre-durable upgrade keeps the original tables (and what did not fit our columns).
ARCHIVE_SCHEMA = "dtask_legacy"

# The 0.7.2 tables, column by column (information_schema data types).
_TS = "timestamp without time zone"
_VC = "character varying"
LEGACY_TASK_COLUMNS = {
    "id": _VC,
    "name": _VC,
    "type": _VC,
    "status": _VC,
    "progress": "double precision",
    "message": "text",
    "payload": "json",
    "result": "json",
    "error": "text",
    "cancel_requested": "integer",
    "created_at": _TS,
    "updated_at": _TS,
    "started_at": _TS,
    "completed_at": _TS,
}
LEGACY_FILE_COLUMNS = {
    "file_id",
    "kb_id",
    "filename",
    "file_type",
    "status",
    "error_message",
    "chunk_count",
    "created_at",
    "updated_at",
}
# Tables only this release's migrations create: finding one without a version record means an
# upgrade stopped half-way (or someone created them by hand).
DURABLE_TABLES = {"task_attempts", "task_slots", "idempotency_keys", "knowledge_bases", "knowledge_chunks"}


class MigrationRefused(RuntimeError):
    """The database is nothing `dtask migrate` may change; nothing was changed."""


Kind = Literal["empty", "pre_durable", "current", "older", "refused"]


@dataclass(frozen=True)
class Detection:
    kind: Kind
    head: str
    revision: str | None = None  # the Alembic revision found, if any
    reason: str = ""  # why it was refused, or what was found

    def describe(self) -> str:
        return {
            "empty": "empty database (migrate creates the current schema)",
            "pre_durable": "pre-durable release 0.7.2 (no version record; migrate upgrades it in place)",
            "current": "current (nothing to do)",
            "older": f"older revision {self.revision} (migrate upgrades it to {self.head})",
            "refused": f"refused: {self.reason}",
        }[self.kind]


def _tables(conn: Connection) -> set[str]:
    rows = conn.execute(
        text(
            """SELECT table_name FROM information_schema.tables
            WHERE table_schema = current_schema() AND table_type IN ('BASE TABLE', 'VIEW')"""
        )
    )
    return {r[0] for r in rows}


def _columns(conn: Connection, table: str) -> dict[str, str]:
    rows = conn.execute(
        text(
            """SELECT column_name, data_type FROM information_schema.columns
            WHERE table_schema = current_schema() AND table_name = :t"""
        ),
        {"t": table},
    )
    return {r[0]: r[1] for r in rows}


def _archive_exists(conn: Connection) -> bool:
    return bool(
        conn.execute(
            text("SELECT count(*) FROM pg_namespace WHERE nspname = :s"), {"s": ARCHIVE_SCHEMA}
        ).scalar()
    )


def _shape_mismatch(found: dict[str, str], expected: dict[str, str]) -> str:
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    typed = sorted(c for c in set(found) & set(expected) if expected[c] and found[c] != expected[c])
    parts = [f"missing {', '.join(missing)}"] if missing else []
    parts += [f"unexpected {', '.join(extra)}"] if extra else []
    parts += [f"{c} is {found[c]} (0.7.2: {expected[c]})" for c in typed]
    return "; ".join(parts)


def _alembic(conn: Connection, tables: set[str], head: str) -> Detection:
    versions = [r[0] for r in conn.execute(text("SELECT version_num FROM alembic_version"))]
    if not versions:
        return Detection(
            "refused", head, reason="half-applied: alembic_version exists but records no revision"
        )
    if len(versions) > 1:
        return Detection(
            "refused", head, reason=f"alembic_version records several revisions: {sorted(versions)}"
        )
    revision = versions[0]
    script = ScriptDirectory.from_config(alembic_config())
    if revision not in {s.revision for s in script.walk_revisions()}:
        return Detection(
            "refused",
            head,
            revision,
            f"the database is at revision {revision!r}, which this release does not know (written by a "
            f"newer release?); this release's head is {head}",
        )
    if "tasks" not in tables:
        return Detection(
            "refused",
            head,
            revision,
            f"half-applied: alembic_version says {revision} but table tasks is missing",
        )
    return Detection("current" if revision == head else "older", head, revision)


def classify(conn: Connection) -> Detection:
    """The starting point of the database ``conn`` is connected to."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head() or ""
    tables = _tables(conn)
    if "alembic_version" in tables:
        return _alembic(conn, tables, head)
    durable = sorted(tables & DURABLE_TABLES)
    if durable:
        return Detection(
            "refused",
            head,
            reason=f"half-applied: tables of this release ({', '.join(durable)}) but no version record",
        )
    if _archive_exists(conn):
        return Detection(
            "refused",
            head,
            reason=f"half-applied: schema {ARCHIVE_SCHEMA} (archived pre-durable tables) exists "
            "but no version record",
        )
    if not tables:
        return Detection("empty", head)
    unknown = sorted(tables - {"tasks", "knowledge_files"})
    if unknown or "tasks" not in tables:
        return Detection(
            "refused",
            head,
            reason=f"unknown tables and no version record: {', '.join(unknown or sorted(tables))} "
            "(migrate handles an empty database, the pre-durable 0.7.2 tables or its own Alembic history)",
        )
    task_cols = _columns(conn, "tasks")
    if "task_type" in task_cols or task_cols.get("id") == "uuid":
        return Detection(
            "refused", head, reason="half-applied: table tasks has this release's shape but no version"
        )
    mismatch = _shape_mismatch(task_cols, LEGACY_TASK_COLUMNS)
    if mismatch:
        return Detection("refused", head, reason=f"table tasks is not the 0.7.2 shape: {mismatch}")
    if "knowledge_files" in tables:
        mismatch = _shape_mismatch(_columns(conn, "knowledge_files"), dict.fromkeys(LEGACY_FILE_COLUMNS, ""))
        if mismatch:
            return Detection(
                "refused", head, reason=f"table knowledge_files is not the 0.7.2 shape: {mismatch}"
            )
    return Detection("pre_durable", head)
