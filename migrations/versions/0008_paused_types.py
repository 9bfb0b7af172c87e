"""paused_types: task types an operator paused (their tasks are not claimed while paused)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "paused_types",
        sa.Column("task_type", sa.Text(), primary_key=True),
        sa.Column("paused_by", sa.Text(), nullable=True),
        sa.Column("paused_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.clock_timestamp()),
    )


def downgrade() -> None:
    op.drop_table("paused_types")
