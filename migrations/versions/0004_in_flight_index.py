"""index of the messages in flight (pending tasks published lately), for the publish budget

Revision ID: 0004
Revises: e0001
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
# The runtime's history continues after the domains' tables: one linear chain, one head.
down_revision = "e0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_tasks_in_flight", "tasks", ["last_published_at"],
        postgresql_where=sa.text("status = 'pending' AND last_published_at IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_tasks_in_flight", table_name="tasks")
