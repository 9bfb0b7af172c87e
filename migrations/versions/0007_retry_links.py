"""retry_of / retried_by: a task retried by hand and its retry name each other

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import UUID

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for column in ("retry_of", "retried_by"):
        op.add_column("tasks", sa.Column(column, UUID(as_uuid=True), nullable=True))


def downgrade() -> None:
    for column in ("retried_by", "retry_of"):
        op.drop_column("tasks", column)
