"""knowledge domain: a file's content hash (one file per content in a base), whether it was
refused at upload, and the file types rst, docx, csv, json and "other" (kept, ended error_parsing)

Revision ID: k0002
Revises: 0005
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "k0002"
down_revision = "0005"
branch_labels = None
depends_on = None

TYPES = "('txt', 'md', 'html', 'pdf', 'rst', 'docx', 'csv', 'json', 'other')"
OLD_TYPES = "('txt', 'md', 'html', 'pdf')"


def upgrade() -> None:
    op.add_column("knowledge_files", sa.Column("content_hash", sa.String(length=64), nullable=True))
    op.add_column(
        "knowledge_files",
        sa.Column("refused_at_upload", sa.Boolean(), server_default=sa.false(), nullable=False),
    )
    op.create_index(
        "uq_knowledge_files_kb_hash", "knowledge_files", ["kb_id", "content_hash"], unique=True
    )
    op.drop_constraint("file_type", "knowledge_files", type_="check")
    op.create_check_constraint("file_type", "knowledge_files", f"file_type IN {TYPES}")


def downgrade() -> None:
    op.drop_constraint("file_type", "knowledge_files", type_="check")
    op.create_check_constraint("file_type", "knowledge_files", f"file_type IN {OLD_TYPES}")
    op.drop_index("uq_knowledge_files_kb_hash", table_name="knowledge_files")
    op.drop_column("knowledge_files", "refused_at_upload")
    op.drop_column("knowledge_files", "content_hash")
