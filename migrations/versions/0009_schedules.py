"""schedules and schedule_runs: durable periodic tasks, one task per (schedule, slot instant)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB, UUID

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "schedules",
        sa.Column("id", UUID(as_uuid=True), nullable=False),
        sa.Column("owner", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("task_type", sa.Text(), nullable=False),
        sa.Column("payload", JSONB(), nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("cron", sa.Text(), nullable=True),
        sa.Column("every_seconds", sa.Float(), nullable=True),
        sa.Column("timezone", sa.Text(), nullable=False, server_default="UTC"),
        sa.Column("priority", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("next_run_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("paused_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.clock_timestamp()
        ),
        sa.Column("last_fired_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.CheckConstraint("(cron IS NULL) <> (every_seconds IS NULL)", name="ck_schedules_one_rule"),
        sa.CheckConstraint(
            "every_seconds IS NULL OR (every_seconds >= 1.0 AND every_seconds < 'Infinity'::float8)",
            name="ck_schedules_every_seconds_range",
        ),
        sa.CheckConstraint("priority BETWEEN -100 AND 100", name="ck_schedules_priority_range"),
        sa.PrimaryKeyConstraint("id", name="pk_schedules"),
    )
    op.create_index("uq_schedules_owner_name", "schedules", ["owner", "name"], unique=True)
    op.create_index(
        "ix_schedules_due", "schedules", ["next_run_at"], postgresql_where=sa.text("paused_at IS NULL")
    )
    op.create_table(
        "schedule_runs",
        sa.Column("schedule_id", UUID(as_uuid=True), nullable=False),
        sa.Column("slot_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("task_id", UUID(as_uuid=True), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.clock_timestamp()
        ),
        sa.ForeignKeyConstraint(
            ["schedule_id"],
            ["schedules.id"],
            name="fk_schedule_runs_schedule_id_schedules",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("schedule_id", "slot_at", name="pk_schedule_runs"),
    )


def downgrade() -> None:
    op.drop_table("schedule_runs")
    op.drop_index("ix_schedules_due", table_name="schedules")
    op.drop_index("uq_schedules_owner_name", table_name="schedules")
    op.drop_table("schedules")
