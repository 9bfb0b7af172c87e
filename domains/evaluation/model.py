"""Evaluation datasets, their items, evaluation runs and their per-item outcomes (PostgreSQL).

A dataset or run that a task is working on names that task and the attempt that claimed it
(``task_id``, ``attempt_token``); every write by a handler matches on both, so a late write from
an attempt that lost its lease, or from the task a resume replaced, matches no row. Items are
unique per dataset by identity (source chunk, ordinal) and by position (``seq``): a batch written
twice is refused by the database, not merely avoided by the code.
"""

from __future__ import annotations

from sqlalchemy import (
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Table,
    Text,
    UniqueConstraint,
    func,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID

from tasks_core.model import metadata, sql_in

# Dataset statuses.
GENERATING = "generating"
COMPLETED = "completed"
FAILED = "failed"
CANCELLED = "cancelled"
DATASET_STATUSES = (GENERATING, COMPLETED, FAILED, CANCELLED)
# Run statuses.
RUNNING = "running"
RUN_STATUSES = (RUNNING, COMPLETED, FAILED, CANCELLED)


evaluation_datasets = Table(
    "evaluation_datasets",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("owner", Text, nullable=False),
    Column("base_id", String(64), ForeignKey("knowledge_bases.id", ondelete="CASCADE"), nullable=False),
    Column("target", Integer, nullable=False),
    Column("item_count", Integer, nullable=False, server_default="0"),
    Column("status", String(16), nullable=False, server_default=GENERATING),
    Column("error_message", Text, nullable=True),
    # The task generating (or last generating) it; a pruned task leaves the dataset alone.
    Column("task_id", UUID(as_uuid=True), ForeignKey("tasks.id", ondelete="SET NULL"), nullable=True),
    # The attempt that claimed the generation (NULL until the task's first claim).
    Column("attempt_token", UUID(as_uuid=True), nullable=True),
    Column("generator", Text, nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.clock_timestamp()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.clock_timestamp()),
    CheckConstraint(f"status IN {sql_in(DATASET_STATUSES)}", name="status"),
    CheckConstraint("target > 0 AND item_count >= 0 AND item_count <= target", name="count"),
    CheckConstraint(f"status <> '{COMPLETED}' OR item_count = target", name="completed_full"),
)
Index("ix_evaluation_datasets_owner", evaluation_datasets.c.owner, evaluation_datasets.c.created_at)
Index("ix_evaluation_datasets_task", evaluation_datasets.c.task_id)

evaluation_items = Table(
    "evaluation_items",
    metadata,
    Column(
        "dataset_id",
        String(64),
        ForeignKey("evaluation_datasets.id", ondelete="CASCADE"),
        primary_key=True,
    ),
    # Position in the dataset, 0 .. target-1: items are paged and evaluated in this order.
    Column("seq", Integer, primary_key=True),
    Column("chunk_id", String(128), nullable=False),
    # Which question drawn from that chunk (a chunk can give several).
    Column("ordinal", Integer, nullable=False),
    Column("question", Text, nullable=False),
    Column("answer", Text, nullable=False),
    # Chunks a retriever should return for the question (the source chunk first).
    Column("relevant_chunk_ids", ARRAY(Text), nullable=False),
    Column("attempt_token", UUID(as_uuid=True), nullable=True),
    UniqueConstraint("dataset_id", "chunk_id", "ordinal", name="uq_evaluation_items_identity"),
    CheckConstraint("seq >= 0 AND ordinal >= 0", name="positions"),
)

evaluation_runs = Table(
    "evaluation_runs",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("owner", Text, nullable=False),
    Column(
        "dataset_id", String(64), ForeignKey("evaluation_datasets.id", ondelete="CASCADE"), nullable=False
    ),
    Column("base_id", String(64), ForeignKey("knowledge_bases.id", ondelete="CASCADE"), nullable=False),
    Column("top_k", Integer, nullable=False),
    Column("status", String(16), nullable=False, server_default=RUNNING),
    Column("items_total", Integer, nullable=False),
    Column("items_done", Integer, nullable=False, server_default="0"),
    # hit_rate, recall, mrr (at top_k): set with `completed`, in the task's success transaction.
    Column("metrics", JSONB, nullable=True),
    Column("error_message", Text, nullable=True),
    Column("task_id", UUID(as_uuid=True), ForeignKey("tasks.id", ondelete="SET NULL"), nullable=True),
    Column("attempt_token", UUID(as_uuid=True), nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.clock_timestamp()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.clock_timestamp()),
    CheckConstraint(f"status IN {sql_in(RUN_STATUSES)}", name="status"),
    CheckConstraint("top_k > 0 AND items_done >= 0 AND items_done <= items_total", name="count"),
)
Index("ix_evaluation_runs_task", evaluation_runs.c.task_id)
Index("ix_evaluation_runs_dataset", evaluation_runs.c.dataset_id)

evaluation_run_items = Table(
    "evaluation_run_items",
    metadata,
    Column("run_id", String(64), ForeignKey("evaluation_runs.id", ondelete="CASCADE"), primary_key=True),
    Column("seq", Integer, primary_key=True),
    Column("hit", Boolean, nullable=False),
    # 1-based rank of the first relevant chunk among the top_k, NULL when none was returned.
    Column("rank", Integer, nullable=True),
    Column("recall", Float, nullable=False),
    Column("retrieved_chunk_ids", ARRAY(Text), nullable=False),
    Column("attempt_token", UUID(as_uuid=True), nullable=False),
)
