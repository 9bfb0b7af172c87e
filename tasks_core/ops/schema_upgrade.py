"""`dtask migrate`: one transaction, under an advisory lock, from any accepted starting point to head.

The lock is taken before the database is even looked at, so of two concurrent runs one applies and
the other, once it gets the lock, finds a current schema and does nothing. Everything (detection,
the pre-durable conversion, Alembic's DDL and its version record) commits together or not at all:
PostgreSQL's DDL is transactional, so a step that fails leaves the database as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from alembic import command
from sqlalchemy import text
from sqlalchemy.engine import Connection

from tasks_core.db import alembic_config, make_engine
from tasks_core.ops import legacy_upgrade
from tasks_core.ops.schema_detect import Detection, MigrationRefused, classify

__all__ = ["MigrationRefused", "Outcome", "detect", "upgrade_database"]

# pg_advisory_xact_lock key of `dtask migrate` ("dtaskmig" as a bigint).
MIGRATE_LOCK_KEY = 0x647461736B6D6967


@dataclass
class Outcome:
    found: Detection
    applied: bool
    counts: dict[str, int] = field(default_factory=dict)


# Called after each named step, inside the transaction: tests make one raise.
StepHook = Callable[[str], None]


def _upgrade(conn: Connection, timeout_seconds: float, after_step: StepHook) -> Outcome:
    conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATE_LOCK_KEY})
    found = classify(conn)
    if found.kind == "refused":
        raise MigrationRefused(found.reason)
    if found.kind == "current":
        return Outcome(found, applied=False)
    counts: dict[str, int] = {}
    has_files = False
    if found.kind == "pre_durable":
        has_files = bool(conn.execute(text("SELECT to_regclass('knowledge_files') IS NOT NULL")).scalar())
        legacy_upgrade.check(conn, has_files)
        legacy_upgrade.archive(conn, has_files)
        after_step("archive")
    cfg = alembic_config()
    cfg.attributes["connection"] = conn  # env.py runs in this transaction, not one of its own
    command.upgrade(cfg, "head")
    after_step("schema")
    if found.kind == "pre_durable":
        counts["tasks"] = legacy_upgrade.copy_tasks(conn, timeout_seconds)
        after_step("tasks")
        if has_files:
            counts["bases"], counts["files"] = legacy_upgrade.copy_knowledge(conn)
            after_step("knowledge")
    return Outcome(found, applied=True, counts=counts)


async def upgrade_database(
    url: str, *, timeout_seconds: float, after_step: StepHook | None = None
) -> Outcome:
    """Bring the database at ``url`` to head; ``timeout_seconds`` is given to pre-durable tasks."""
    engine = make_engine(url, pool_size=1, max_overflow=0)
    try:
        async with engine.begin() as conn:
            return await conn.run_sync(_upgrade, timeout_seconds, after_step or (lambda step: None))
    finally:
        await engine.dispose()


async def detect(url: str) -> Detection:
    engine = make_engine(url, pool_size=1, max_overflow=0)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(classify)
    finally:
        await engine.dispose()
