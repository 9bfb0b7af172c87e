"""capacity slots (claims without a cluster-wide lock), index of pending tasks with no message

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "task_slots",
        sa.Column("slot", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("task_id", postgresql.UUID(as_uuid=True), nullable=True),
        sa.Column("token", postgresql.UUID(as_uuid=True), nullable=True),
        sa.PrimaryKeyConstraint("slot", name=op.f("pk_task_slots")),
        sa.UniqueConstraint("task_id", name=op.f("uq_task_slots_task_id")),
    )
    # Tasks running at upgrade time keep holding capacity: each gets a slot of its own.
    op.execute(
        """INSERT INTO task_slots (slot, task_id, token)
        SELECT row_number() OVER (ORDER BY started_at, id) - 1, id, attempt_token
        FROM tasks WHERE status = 'running'"""
    )
    op.create_index(
        "ix_tasks_unpublished", "tasks", ["created_at", "id"],
        postgresql_where=sa.text("status = 'pending' AND last_published_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_tasks_unpublished", table_name="tasks")
    op.drop_table("task_slots")
