"""durable task table, attempts audit table, diagnostics domain tables

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

NOW = sa.text("clock_timestamp()")
TZ = sa.DateTime(timezone=True)
UUID = postgresql.UUID(as_uuid=True)


def upgrade() -> None:
    op.create_table(
        "tasks",
        sa.Column("id", UUID, nullable=False),
        sa.Column("task_type", sa.Text(), nullable=False),
        sa.Column("handler_version", sa.Integer(), nullable=False),
        sa.Column("payload", postgresql.JSONB(), server_default=sa.text("'{}'::jsonb"), nullable=False),
        sa.Column("owner", sa.Text(), nullable=True),
        sa.Column("status", sa.Text(), server_default="pending", nullable=False),
        sa.Column("dedupe_key", sa.Text(), nullable=True),
        sa.Column("attempt_token", UUID, nullable=True),
        sa.Column("attempt_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("lease_expires_at", TZ, nullable=True),
        sa.Column("heartbeat_at", TZ, nullable=True),
        sa.Column("cancel_requested_at", TZ, nullable=True),
        sa.Column("timeout_seconds", sa.Float(), nullable=False),
        sa.Column("progress", sa.Float(), server_default="0", nullable=False),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("result", postgresql.JSONB(), nullable=True),
        sa.Column("error", postgresql.JSONB(), nullable=True),
        sa.Column("not_before", TZ, nullable=True),
        sa.Column("created_at", TZ, server_default=NOW, nullable=False),
        sa.Column("started_at", TZ, nullable=True),
        sa.Column("finished_at", TZ, nullable=True),
        sa.Column("last_published_at", TZ, nullable=True),
        sa.Column("publish_error", sa.Text(), nullable=True),
        sa.CheckConstraint(
            "status IN ('pending', 'running', 'success', 'failed', 'cancelled')", name=op.f("ck_tasks_status")
        ),
        sa.CheckConstraint(
            "timeout_seconds > 0 AND timeout_seconds < 'Infinity'::float8", name=op.f("ck_tasks_timeout_positive")
        ),
        sa.CheckConstraint("progress >= 0 AND progress <= 100", name=op.f("ck_tasks_progress_range")),
        sa.CheckConstraint("handler_version >= 0", name=op.f("ck_tasks_handler_version")),
        sa.CheckConstraint(
            "(status = 'running') = (attempt_token IS NOT NULL AND lease_expires_at IS NOT NULL)",
            name=op.f("ck_tasks_running_owner"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tasks")),
    )
    op.create_index(
        "uq_tasks_active_dedupe", "tasks", ["task_type", "dedupe_key"], unique=True,
        postgresql_where=sa.text("status IN ('pending', 'running') AND dedupe_key IS NOT NULL"),
    )
    op.create_index(
        "ix_tasks_pending_created", "tasks", ["created_at", "id"], postgresql_where=sa.text("status = 'pending'")
    )
    op.create_index(
        "ix_tasks_running_lease", "tasks", ["lease_expires_at"], postgresql_where=sa.text("status = 'running'")
    )
    op.create_index("ix_tasks_created_id", "tasks", ["created_at", "id"])
    op.create_index("ix_tasks_status_type", "tasks", ["status", "task_type"])
    op.create_index(
        "ix_tasks_finished", "tasks", ["finished_at"],
        postgresql_where=sa.text("status IN ('success', 'failed', 'cancelled')"),
    )

    op.create_table(
        "task_attempts",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("task_id", UUID, nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("token", UUID, nullable=False),
        sa.Column("worker", sa.Text(), nullable=True),
        sa.Column("claimed_at", TZ, nullable=False),
        sa.Column("ended_at", TZ, nullable=True),
        sa.Column("outcome", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["task_id"], ["tasks.id"], name=op.f("fk_task_attempts_task_id_tasks"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_task_attempts")),
        sa.UniqueConstraint("token", name=op.f("uq_task_attempts_token")),
    )
    op.create_index("ix_task_attempts_task", "task_attempts", ["task_id", "attempt"])

    op.create_table(
        "diagnostics_runs",
        sa.Column("task_id", UUID, nullable=False),
        sa.Column("attempt_token", UUID, nullable=True),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("steps_done", sa.Integer(), server_default="0", nullable=False),
        sa.Column("hook", sa.Text(), nullable=True),
        sa.Column("updated_at", TZ, server_default=NOW, nullable=False),
        sa.CheckConstraint(
            "status IN ('running', 'done', 'failed', 'cancelled')", name=op.f("ck_diagnostics_runs_status")
        ),
        sa.ForeignKeyConstraint(
            ["task_id"], ["tasks.id"], name=op.f("fk_diagnostics_runs_task_id_tasks"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("task_id", name=op.f("pk_diagnostics_runs")),
    )
    op.create_table(
        "diagnostics_effects",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("task_id", UUID, nullable=False),
        sa.Column("attempt_token", UUID, nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("created_at", TZ, server_default=NOW, nullable=False),
        sa.ForeignKeyConstraint(
            ["task_id"], ["tasks.id"], name=op.f("fk_diagnostics_effects_task_id_tasks"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_diagnostics_effects")),
    )


def downgrade() -> None:
    op.drop_table("diagnostics_effects")
    op.drop_table("diagnostics_runs")
    op.drop_index("ix_task_attempts_task", table_name="task_attempts")
    op.drop_table("task_attempts")
    op.drop_table("tasks")
