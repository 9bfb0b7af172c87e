"""knowledge domain: bases, files (the pre-durable table plus task/attempt owner columns), chunks

Revision ID: k0001
Revises: 0003
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "k0001"
down_revision = "0003"
branch_labels = None
depends_on = None

NOW = sa.text("clock_timestamp()")
TZ = sa.DateTime(timezone=True)
STATUSES = "('uploaded', 'parsing', 'parsed', 'indexing', 'indexed', 'error_parsing', 'error_indexing')"


def upgrade() -> None:
    op.create_table(
        "knowledge_bases",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("embedder", sa.Text(), nullable=False),
        sa.Column("dimension", sa.Integer(), nullable=False),
        sa.Column("created_at", TZ, server_default=NOW, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_knowledge_bases")),
        sa.UniqueConstraint("owner", "name", name="uq_knowledge_bases_owner_name"),
    )
    op.create_table(
        "knowledge_files",
        sa.Column("file_id", sa.String(length=64), nullable=False),
        sa.Column("kb_id", sa.String(length=64), nullable=False),
        sa.Column("filename", sa.Text(), nullable=False),
        sa.Column("file_type", sa.String(length=16), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("status", sa.String(length=32), server_default="uploaded", nullable=False),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("chunk_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("task_id", sa.UUID(), nullable=True),
        sa.Column("attempt_token", sa.UUID(), nullable=True),
        sa.Column("created_at", TZ, server_default=NOW, nullable=False),
        sa.Column("updated_at", TZ, server_default=NOW, nullable=False),
        sa.CheckConstraint(
            "file_type IN ('txt', 'md', 'html', 'pdf')", name=op.f("ck_knowledge_files_file_type")
        ),
        sa.CheckConstraint(f"status IN {STATUSES}", name=op.f("ck_knowledge_files_status")),
        sa.CheckConstraint(
            "status NOT IN ('parsing', 'parsed', 'indexing') "
            "OR (task_id IS NOT NULL AND attempt_token IS NOT NULL)",
            name=op.f("ck_knowledge_files_owned_in_progress"),
        ),
        sa.ForeignKeyConstraint(
            ["kb_id"],
            ["knowledge_bases.id"],
            name=op.f("fk_knowledge_files_kb_id_knowledge_bases"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["task_id"], ["tasks.id"], name=op.f("fk_knowledge_files_task_id_tasks"), ondelete="SET NULL"
        ),
        sa.PrimaryKeyConstraint("file_id", name=op.f("pk_knowledge_files")),
    )
    op.create_index("ix_knowledge_files_kb_created", "knowledge_files", ["kb_id", "created_at", "file_id"])
    op.create_index("ix_knowledge_files_task", "knowledge_files", ["task_id"])
    op.create_table(
        "knowledge_chunks",
        sa.Column("chunk_id", sa.String(length=128), nullable=False),
        sa.Column("file_id", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("attempt_token", sa.UUID(), nullable=False),
        sa.ForeignKeyConstraint(
            ["file_id"],
            ["knowledge_files.file_id"],
            name=op.f("fk_knowledge_chunks_file_id_knowledge_files"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("chunk_id", name=op.f("pk_knowledge_chunks")),
    )
    op.create_index("ix_knowledge_chunks_file", "knowledge_chunks", ["file_id", "seq"])


def downgrade() -> None:
    op.drop_index("ix_knowledge_chunks_file", table_name="knowledge_chunks")
    op.drop_table("knowledge_chunks")
    op.drop_index("ix_knowledge_files_task", table_name="knowledge_files")
    op.drop_index("ix_knowledge_files_kb_created", table_name="knowledge_files")
    op.drop_table("knowledge_files")
    op.drop_table("knowledge_bases")
