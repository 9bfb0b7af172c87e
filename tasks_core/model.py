"""The task table and the attempts audit table (SQLAlchemy Core; Alembic migrates them)."""

from __future__ import annotations

import enum

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Table,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
metadata = MetaData(naming_convention=NAMING)


def sql_in(values: tuple[str, ...]) -> str:
    """``('a', 'b')``: a list of our own constant words for a CHECK constraint or a query."""
    return "(" + ", ".join(f"'{v}'" for v in values) + ")"


class Status(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCESS = "success"
    FAILED = "failed"
    CANCELLED = "cancelled"


ACTIVE = (Status.PENDING, Status.RUNNING)
TERMINAL = (Status.SUCCESS, Status.FAILED, Status.CANCELLED)
LEGACY_VERSION = 0
MIN_PRIORITY, MAX_PRIORITY = -100, 100

tasks = Table(
    "tasks",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True),
    Column("task_type", Text, nullable=False),
    Column("handler_version", Integer, nullable=False),
    Column("payload", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("owner", Text, nullable=True),
    Column("status", Text, nullable=False, server_default=Status.PENDING.value),
    Column("dedupe_key", Text, nullable=True),
    Column("attempt_token", UUID(as_uuid=True), nullable=True),
    Column("attempt_count", Integer, nullable=False, server_default="0"),
    Column("lease_expires_at", DateTime(timezone=True), nullable=True),
    Column("heartbeat_at", DateTime(timezone=True), nullable=True),
    Column("cancel_requested_at", DateTime(timezone=True), nullable=True),
    Column("timeout_seconds", Float, nullable=False),
    Column("progress", Float, nullable=False, server_default="0"),
    Column("message", Text, nullable=True),
    Column("result", JSONB, nullable=True),
    Column("error", JSONB, nullable=True),
    # Not claimable before this instant: the submission's run_at, or a retry's backoff.
    Column("not_before", DateTime(timezone=True), nullable=True),
    # The instant the submission asked for (run_at, or now + delay_seconds); kept for users.
    Column("run_at", DateTime(timezone=True), nullable=True),
    # Among claimable tasks the higher priority goes first, then the older.
    Column("priority", Integer, nullable=False, server_default="0"),
    # A retry by hand is a new task: it names the one it retries, and that one names it (set
    # once, in the retry's own transaction: a task is retried at most once). No foreign keys:
    # pruning one side leaves the other's link dangling (GET answers 404) instead of making every
    # prune delete look the table up for rows that name it.
    Column("retry_of", UUID(as_uuid=True), nullable=True),
    Column("retried_by", UUID(as_uuid=True), nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.clock_timestamp()),
    Column("started_at", DateTime(timezone=True), nullable=True),
    Column("finished_at", DateTime(timezone=True), nullable=True),
    Column("last_published_at", DateTime(timezone=True), nullable=True),
    # Last publication failure (NULL after a successful publish): tells users why work waits.
    Column("publish_error", Text, nullable=True),
    CheckConstraint("status IN ('pending', 'running', 'success', 'failed', 'cancelled')", name="status"),
    CheckConstraint("timeout_seconds > 0 AND timeout_seconds < 'Infinity'::float8", name="timeout_positive"),
    CheckConstraint("progress >= 0 AND progress <= 100", name="progress_range"),
    CheckConstraint("handler_version >= 0", name="handler_version"),
    CheckConstraint(f"priority BETWEEN {MIN_PRIORITY} AND {MAX_PRIORITY}", name="priority_range"),
    # A running row always has an owner and a lease; nothing else does.
    CheckConstraint(
        "(status = 'running') = (attempt_token IS NOT NULL AND lease_expires_at IS NOT NULL)",
        name="running_owner",
    ),
)

# I4: at most one active task per (owner, task_type, dedupe_key); terminal rows release the key.
# Keys never cross owners. NULLS NOT DISTINCT: tasks submitted without an owner (the Python API)
# still share one key space among themselves.
Index(
    "uq_tasks_active_dedupe",
    tasks.c.owner,
    tasks.c.task_type,
    tasks.c.dedupe_key,
    unique=True,
    postgresql_where=text("status IN ('pending', 'running') AND dedupe_key IS NOT NULL"),
    postgresql_nulls_not_distinct=True,
)
# Oldest pending first: the oldest pending age, and waiting_reason.
Index(
    "ix_tasks_pending_created",
    tasks.c.created_at,
    tasks.c.id,
    postgresql_where=text("status = 'pending'"),
)
# Pending tasks in the order they are taken (higher priority, then older): the publisher's pick.
Index(
    "ix_tasks_pending_priority",
    tasks.c.priority.desc(),
    tasks.c.created_at,
    tasks.c.id,
    postgresql_where=text("status = 'pending'"),
)
# Pending tasks with no message in flight, in the order they are taken: what the relay hands free
# slots to.
Index(
    "ix_tasks_unpublished",
    tasks.c.priority.desc(),
    tasks.c.created_at,
    tasks.c.id,
    postgresql_where=text("status = 'pending' AND last_published_at IS NULL"),
)
# Messages in flight (pending tasks published lately), newest first: the publish budget counts at most
# capacity + ahead of them, so a backlog of any size costs that count a few index entries, not a scan
# of every pending row (with generic plans, the scan cost 26 ms per relay at 100 k pending).
Index(
    "ix_tasks_in_flight",
    tasks.c.last_published_at,
    postgresql_where=text("status = 'pending' AND last_published_at IS NOT NULL"),
)
# Capacity counts and the reconciler's expired-lease scan.
Index(
    "ix_tasks_running_lease",
    tasks.c.lease_expires_at,
    postgresql_where=text("status = 'running'"),
)
# Keyset listing (newest first) and prune by age.
Index("ix_tasks_created_id", tasks.c.created_at, tasks.c.id)
# One owner's listing, summary and quota counts, without scanning other tenants' rows.
Index("ix_tasks_owner_created", tasks.c.owner, tasks.c.created_at, tasks.c.id)
Index("ix_tasks_owner_status", tasks.c.owner, tasks.c.status, tasks.c.task_type)
# An owner's pending queue: its quota, and a pending task's place among its owner's tasks.
Index(
    "ix_tasks_owner_pending",
    tasks.c.owner,
    tasks.c.created_at,
    tasks.c.id,
    postgresql_where=text("status = 'pending'"),
)
Index("ix_tasks_status_type", tasks.c.status, tasks.c.task_type)
Index(
    "ix_tasks_finished",
    tasks.c.finished_at,
    postgresql_where=text("status IN ('success', 'failed', 'cancelled')"),
)

task_attempts = Table(
    "task_attempts",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("task_id", UUID(as_uuid=True), ForeignKey("tasks.id", ondelete="CASCADE"), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("token", UUID(as_uuid=True), nullable=False, unique=True),
    Column("worker", Text, nullable=True),
    Column("claimed_at", DateTime(timezone=True), nullable=False),
    # When ownership really ended: the terminal commit, or the lapsed lease for a dead owner.
    Column("ended_at", DateTime(timezone=True), nullable=True),
    Column("outcome", Text, nullable=True),
    # The full error behind the outcome (exception text may name internal hosts): for operators;
    # task owners see only the short form in the task's `error`.
    Column("detail", Text, nullable=True),
)
Index("ix_task_attempts_task", task_attempts.c.task_id, task_attempts.c.attempt)

# Capacity (I5) as rows: a claim takes a free slot below DTASK_CAPACITY (FOR UPDATE SKIP LOCKED) in
# the same statement that marks its task running, and the terminal statement gives it back. Claimers
# never wait on each other, and two of them can never hold one slot. Rows are added up to the
# configured capacity on demand; lowering the capacity takes effect as running tasks finish.
task_slots = Table(
    "task_slots",
    metadata,
    Column("slot", Integer, primary_key=True, autoincrement=False),
    Column("task_id", UUID(as_uuid=True), nullable=True, unique=True),
    Column("token", UUID(as_uuid=True), nullable=True),
)

# Task types an operator paused: their tasks are not claimed, relayed or published while a row is
# here (running ones finish); resuming deletes the row and publishes what waits.
paused_types = Table(
    "paused_types",
    metadata,
    Column("task_type", Text, primary_key=True),
    Column("paused_by", Text, nullable=True),
    Column("paused_at", DateTime(timezone=True), nullable=False, server_default=func.clock_timestamp()),
)

# Idempotent submission: a retried request with the same Idempotency-Key (per owner) gets the
# task(s) the first one created. The row commits in the same transaction as those tasks, so a
# client that gave up waiting can never create a second copy. Rows older than 24 h are pruned.
idempotency_keys = Table(
    "idempotency_keys",
    metadata,
    Column("owner", Text, primary_key=True),
    Column("key", Text, primary_key=True),
    # sha256 of the request (route and body): the same key with another request is refused.
    Column("request_hash", Text, nullable=False),
    Column("task_ids", JSONB, nullable=False),
    Column("response", JSONB, nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.clock_timestamp()),
)
Index("ix_idempotency_keys_created", idempotency_keys.c.created_at)
