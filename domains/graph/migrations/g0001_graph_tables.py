"""graph domain: builds, entities and weighted co-occurrence edges of a base's knowledge graph

Revision ID: g0001
Revises: k0001
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "g0001"
down_revision = "k0001"
branch_labels = None
depends_on = None

NOW = sa.text("clock_timestamp()")
TZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "graph_builds",
        sa.Column("id", sa.UUID(), nullable=False),
        sa.Column("base_id", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), server_default="building", nullable=False),
        sa.Column("task_id", sa.UUID(), nullable=True),
        sa.Column("attempt_token", sa.UUID(), nullable=True),
        sa.Column("extractor", sa.Text(), nullable=True),
        sa.Column("cursor_file", sa.String(length=64), nullable=True),
        sa.Column("cursor_seq", sa.Integer(), nullable=True),
        sa.Column("chunks_done", sa.Integer(), server_default="0", nullable=False),
        sa.Column("chunk_total", sa.Integer(), nullable=True),
        sa.Column("entity_count", sa.Integer(), nullable=True),
        sa.Column("edge_count", sa.Integer(), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("created_at", TZ, server_default=NOW, nullable=False),
        sa.Column("updated_at", TZ, server_default=NOW, nullable=False),
        sa.Column("finished_at", TZ, nullable=True),
        sa.CheckConstraint(
            "status IN ('building', 'built', 'failed', 'cancelled')", name=op.f("ck_graph_builds_status")
        ),
        sa.ForeignKeyConstraint(
            ["base_id"],
            ["knowledge_bases.id"],
            name=op.f("fk_graph_builds_base_id_knowledge_bases"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["task_id"], ["tasks.id"], name=op.f("fk_graph_builds_task_id_tasks"), ondelete="SET NULL"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_graph_builds")),
    )
    op.create_index("ix_graph_builds_base", "graph_builds", ["base_id", "status", "created_at"])
    op.create_index("ix_graph_builds_task", "graph_builds", ["task_id"])
    op.create_table(
        "graph_entities",
        sa.Column("build_id", sa.UUID(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("mentions", sa.Integer(), nullable=False),
        sa.Column("chunks", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["build_id"],
            ["graph_builds.id"],
            name=op.f("fk_graph_entities_build_id_graph_builds"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("build_id", "name", name="pk_graph_entities"),
    )
    op.create_index(
        "ix_graph_entities_rank", "graph_entities", ["build_id", sa.text("mentions DESC"), "name"]
    )
    op.create_table(
        "graph_edges",
        sa.Column("build_id", sa.UUID(), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("target", sa.Text(), nullable=False),
        sa.Column("weight", sa.Integer(), nullable=False),
        sa.CheckConstraint("source < target", name=op.f("ck_graph_edges_ordered")),
        sa.ForeignKeyConstraint(
            ["build_id"],
            ["graph_builds.id"],
            name=op.f("fk_graph_edges_build_id_graph_builds"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("build_id", "source", "target", name="pk_graph_edges"),
    )
    op.create_index("ix_graph_edges_target", "graph_edges", ["build_id", "target"])


def downgrade() -> None:
    op.drop_index("ix_graph_edges_target", table_name="graph_edges")
    op.drop_table("graph_edges")
    op.drop_index("ix_graph_entities_rank", table_name="graph_entities")
    op.drop_table("graph_entities")
    op.drop_index("ix_graph_builds_task", table_name="graph_builds")
    op.drop_index("ix_graph_builds_base", table_name="graph_builds")
    op.drop_table("graph_builds")
