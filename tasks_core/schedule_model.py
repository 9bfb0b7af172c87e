"""Durable schedules and the slots they fired (SQLAlchemy Core, on the task tables' ``metadata``).

A schedule names a task (type, payload, priority) and when to create it: a cron expression in a
time zone, or a fixed interval. ``schedule_runs`` holds one row per fired slot; its primary key
(schedule, slot instant) is what makes each slot create at most one task, however many beats run
or restart: the task is inserted only from the slot row that the same statement managed to insert.
"""

from __future__ import annotations

from sqlalchemy import (
    CheckConstraint,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    Table,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID

from tasks_core.model import MAX_PRIORITY, MIN_PRIORITY, metadata

# An interval below this is refused: slots closer than the scheduler duty's own interval would only
# collapse into one task per pass anyway.
MIN_EVERY_SECONDS = 1.0

schedules = Table(
    "schedules",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True),
    # The API key name that created it (`cli` for `dtask schedule add`): its tasks carry it.
    Column("owner", Text, nullable=False),
    Column("name", Text, nullable=False),
    Column("task_type", Text, nullable=False),
    Column("payload", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    # Exactly one of cron (five fields, read in `timezone`) and every_seconds.
    Column("cron", Text, nullable=True),
    Column("every_seconds", Float, nullable=True),
    Column("timezone", Text, nullable=False, server_default="UTC"),
    Column("priority", Integer, nullable=False, server_default="0"),
    # The next slot to fire; while paused it is kept but means nothing (resume recomputes it).
    Column("next_run_at", DateTime(timezone=True), nullable=False),
    Column("paused_at", DateTime(timezone=True), nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.clock_timestamp()),
    Column("last_fired_at", DateTime(timezone=True), nullable=True),
    # Why the last due slot created no task (its type gone, its payload no longer valid), else NULL.
    Column("last_error", Text, nullable=True),
    CheckConstraint("(cron IS NULL) <> (every_seconds IS NULL)", name="one_rule"),
    CheckConstraint(
        "every_seconds IS NULL OR "
        f"(every_seconds >= {MIN_EVERY_SECONDS} AND every_seconds < 'Infinity'::float8)",
        name="every_seconds_range",
    ),
    CheckConstraint(f"priority BETWEEN {MIN_PRIORITY} AND {MAX_PRIORITY}", name="priority_range"),
)
# Names are per owner, like dedupe keys: one tenant's names never collide with (or reveal) another's.
Index("uq_schedules_owner_name", schedules.c.owner, schedules.c.name, unique=True)
# The scheduler's pick: active schedules whose next slot is due.
Index("ix_schedules_due", schedules.c.next_run_at, postgresql_where=text("paused_at IS NULL"))

schedule_runs = Table(
    "schedule_runs",
    metadata,
    Column(
        "schedule_id", UUID(as_uuid=True), ForeignKey("schedules.id", ondelete="CASCADE"), primary_key=True
    ),
    Column("slot_at", DateTime(timezone=True), primary_key=True),
    # No foreign key: pruning old tasks leaves the run (its slot stays taken) with a dangling id.
    Column("task_id", UUID(as_uuid=True), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.clock_timestamp()),
)
