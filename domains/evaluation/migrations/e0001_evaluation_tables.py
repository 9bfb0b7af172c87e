"""evaluation domain: datasets and their items, runs and their per-item outcomes

Revision ID: e0001
Revises: g0001
Create Date: 2026-11-30
"""

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "e0001"
down_revision = "g0001"
branch_labels = None
depends_on = None

NOW = sa.text("clock_timestamp()")
TZ = sa.DateTime(timezone=True)


def _owned(table: str) -> list[Any]:
    return [
        sa.Column("task_id", sa.UUID(), nullable=True),
        sa.Column("attempt_token", sa.UUID(), nullable=True),
        sa.Column("created_at", TZ, server_default=NOW, nullable=False),
        sa.Column("updated_at", TZ, server_default=NOW, nullable=False),
        sa.ForeignKeyConstraint(
            ["task_id"], ["tasks.id"], name=op.f(f"fk_{table}_task_id_tasks"), ondelete="SET NULL"
        ),
        sa.ForeignKeyConstraint(
            ["base_id"],
            ["knowledge_bases.id"],
            name=op.f(f"fk_{table}_base_id_knowledge_bases"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f(f"pk_{table}")),
    ]


def upgrade() -> None:
    op.create_table(
        "evaluation_datasets",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.Text(), nullable=False),
        sa.Column("base_id", sa.String(length=64), nullable=False),
        sa.Column("target", sa.Integer(), nullable=False),
        sa.Column("item_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("status", sa.String(length=16), server_default="generating", nullable=False),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("generator", sa.Text(), nullable=True),
        *_owned("evaluation_datasets"),
        sa.CheckConstraint(
            "status IN ('generating', 'completed', 'failed', 'cancelled')",
            name=op.f("ck_evaluation_datasets_status"),
        ),
        sa.CheckConstraint(
            "target > 0 AND item_count >= 0 AND item_count <= target",
            name=op.f("ck_evaluation_datasets_count"),
        ),
        sa.CheckConstraint(
            "status <> 'completed' OR item_count = target", name=op.f("ck_evaluation_datasets_completed_full")
        ),
    )
    op.create_index("ix_evaluation_datasets_owner", "evaluation_datasets", ["owner", "created_at"])
    op.create_index("ix_evaluation_datasets_task", "evaluation_datasets", ["task_id"])
    op.create_table(
        "evaluation_items",
        sa.Column("dataset_id", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("chunk_id", sa.String(length=128), nullable=False),
        sa.Column("ordinal", sa.Integer(), nullable=False),
        sa.Column("question", sa.Text(), nullable=False),
        sa.Column("answer", sa.Text(), nullable=False),
        sa.Column("relevant_chunk_ids", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("attempt_token", sa.UUID(), nullable=True),
        sa.CheckConstraint("seq >= 0 AND ordinal >= 0", name=op.f("ck_evaluation_items_positions")),
        sa.ForeignKeyConstraint(
            ["dataset_id"],
            ["evaluation_datasets.id"],
            name=op.f("fk_evaluation_items_dataset_id_evaluation_datasets"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("dataset_id", "seq", name=op.f("pk_evaluation_items")),
        sa.UniqueConstraint("dataset_id", "chunk_id", "ordinal", name="uq_evaluation_items_identity"),
    )
    op.create_table(
        "evaluation_runs",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.Text(), nullable=False),
        sa.Column("dataset_id", sa.String(length=64), nullable=False),
        sa.Column("base_id", sa.String(length=64), nullable=False),
        sa.Column("top_k", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), server_default="running", nullable=False),
        sa.Column("items_total", sa.Integer(), nullable=False),
        sa.Column("items_done", sa.Integer(), server_default="0", nullable=False),
        sa.Column("metrics", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        *_owned("evaluation_runs"),
        sa.CheckConstraint(
            "status IN ('running', 'completed', 'failed', 'cancelled')",
            name=op.f("ck_evaluation_runs_status"),
        ),
        sa.CheckConstraint(
            "top_k > 0 AND items_done >= 0 AND items_done <= items_total",
            name=op.f("ck_evaluation_runs_count"),
        ),
        sa.ForeignKeyConstraint(
            ["dataset_id"],
            ["evaluation_datasets.id"],
            name=op.f("fk_evaluation_runs_dataset_id_evaluation_datasets"),
            ondelete="CASCADE",
        ),
    )
    op.create_index("ix_evaluation_runs_task", "evaluation_runs", ["task_id"])
    op.create_index("ix_evaluation_runs_dataset", "evaluation_runs", ["dataset_id"])
    op.create_table(
        "evaluation_run_items",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("hit", sa.Boolean(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("recall", sa.Float(), nullable=False),
        sa.Column("retrieved_chunk_ids", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("attempt_token", sa.UUID(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["evaluation_runs.id"],
            name=op.f("fk_evaluation_run_items_run_id_evaluation_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_id", "seq", name=op.f("pk_evaluation_run_items")),
    )


def downgrade() -> None:
    op.drop_table("evaluation_run_items")
    op.drop_index("ix_evaluation_runs_dataset", table_name="evaluation_runs")
    op.drop_index("ix_evaluation_runs_task", table_name="evaluation_runs")
    op.drop_table("evaluation_runs")
    op.drop_table("evaluation_items")
    op.drop_index("ix_evaluation_datasets_task", table_name="evaluation_datasets")
    op.drop_index("ix_evaluation_datasets_owner", table_name="evaluation_datasets")
    op.drop_table("evaluation_datasets")
