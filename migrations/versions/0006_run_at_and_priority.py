"""run_at and priority: tasks that wait for their instant, and an order among the claimable ones

Revision ID: 0006
Revises: k0002
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "k0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tasks", sa.Column("run_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("tasks", sa.Column("priority", sa.Integer(), nullable=False, server_default="0"))
    op.create_check_constraint("priority_range", "tasks", "priority BETWEEN -100 AND 100")
    op.create_index(
        "ix_tasks_pending_priority", "tasks", [sa.text("priority DESC"), "created_at", "id"],
        postgresql_where=sa.text("status = 'pending'"),
    )
    op.drop_index("ix_tasks_unpublished", table_name="tasks")
    op.create_index(
        "ix_tasks_unpublished", "tasks", [sa.text("priority DESC"), "created_at", "id"],
        postgresql_where=sa.text("status = 'pending' AND last_published_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_tasks_unpublished", table_name="tasks")
    op.create_index(
        "ix_tasks_unpublished", "tasks", ["created_at", "id"],
        postgresql_where=sa.text("status = 'pending' AND last_published_at IS NULL"),
    )
    op.drop_index("ix_tasks_pending_priority", table_name="tasks")
    op.drop_constraint("priority_range", "tasks", type_="check")
    op.drop_column("tasks", "priority")
    op.drop_column("tasks", "run_at")
