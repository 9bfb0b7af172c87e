"""dedupe keys scoped per owner, owner indexes, idempotency keys, attempt error detail

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

ACTIVE_KEYED = sa.text("status IN ('pending', 'running') AND dedupe_key IS NOT NULL")


def upgrade() -> None:
    # Keys never cross owners (a shared key let one tenant block, and learn of, another's task).
    op.drop_index("uq_tasks_active_dedupe", table_name="tasks")
    op.create_index(
        "uq_tasks_active_dedupe", "tasks", ["owner", "task_type", "dedupe_key"], unique=True,
        postgresql_where=ACTIVE_KEYED, postgresql_nulls_not_distinct=True,
    )
    op.create_index("ix_tasks_owner_created", "tasks", ["owner", "created_at", "id"])
    op.create_index("ix_tasks_owner_status", "tasks", ["owner", "status", "task_type"])
    op.create_index(
        "ix_tasks_owner_pending", "tasks", ["owner", "created_at", "id"], postgresql_where=sa.text("status = 'pending'")
    )
    op.add_column("task_attempts", sa.Column("detail", sa.Text(), nullable=True))
    op.create_table(
        "idempotency_keys",
        sa.Column("owner", sa.Text(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("request_hash", sa.Text(), nullable=False),
        sa.Column("task_ids", postgresql.JSONB(), nullable=False),
        sa.Column("response", postgresql.JSONB(), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.text("clock_timestamp()"), nullable=False
        ),
        sa.PrimaryKeyConstraint("owner", "key", name=op.f("pk_idempotency_keys")),
    )
    op.create_index("ix_idempotency_keys_created", "idempotency_keys", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_idempotency_keys_created", table_name="idempotency_keys")
    op.drop_table("idempotency_keys")
    op.drop_column("task_attempts", "detail")
    op.drop_index("ix_tasks_owner_pending", table_name="tasks")
    op.drop_index("ix_tasks_owner_status", table_name="tasks")
    op.drop_index("ix_tasks_owner_created", table_name="tasks")
    op.drop_index("uq_tasks_active_dedupe", table_name="tasks")
    op.create_index(
        "uq_tasks_active_dedupe", "tasks", ["task_type", "dedupe_key"], unique=True, postgresql_where=ACTIVE_KEYED
    )
