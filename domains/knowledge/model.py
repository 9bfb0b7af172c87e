"""Bases, files and chunk texts in PostgreSQL; originals live in S3, vectors in Milvus.

``knowledge_files`` is the pre-durable release's table (string ``file_id`` key, ``kb_id``,
``filename``, ``file_type``, ``status``, ``error_message``, ``chunk_count``, timestamps) plus the
owner columns ``task_id`` and ``attempt_token``: every in-progress state names the task and the
attempt that may move it on, so a late write from any other attempt matches no row.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    String,
    Table,
    Text,
    UniqueConstraint,
    false,
    func,
)
from sqlalchemy.dialects.postgresql import UUID

from tasks_core.model import metadata, sql_in

UPLOADED = "uploaded"
PARSING = "parsing"
PARSED = "parsed"
INDEXING = "indexing"
INDEXED = "indexed"
ERROR_PARSING = "error_parsing"
ERROR_INDEXING = "error_indexing"
STATUSES = (UPLOADED, PARSING, PARSED, INDEXING, INDEXED, ERROR_PARSING, ERROR_INDEXING)
# States a task is still working on: its terminal hook converges whatever is left in them (I6).
IN_PROGRESS = (UPLOADED, PARSING, PARSED, INDEXING)
# States that bind the row to one attempt (an upload waits for its task's first claim).
ATTEMPT_BOUND = (PARSING, PARSED, INDEXING)
ERRORS = (ERROR_PARSING, ERROR_INDEXING)
# "other": a file of no supported type, kept (so one bad file never refuses its upload) and ended
# error_parsing with the reason.
OTHER = "other"
FILE_TYPES = ("txt", "md", "html", "pdf", "rst", "docx", "csv", "json", OTHER)


knowledge_bases = Table(
    "knowledge_bases",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("owner", Text, nullable=False),
    Column("name", Text, nullable=False),
    # The vector space the base's collection holds: indexing with another embedder is refused.
    Column("embedder", Text, nullable=False),
    Column("dimension", Integer, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.clock_timestamp()),
    UniqueConstraint("owner", "name", name="uq_knowledge_bases_owner_name"),
)

knowledge_files = Table(
    "knowledge_files",
    metadata,
    Column("file_id", String(64), primary_key=True),
    Column("kb_id", String(64), ForeignKey("knowledge_bases.id", ondelete="CASCADE"), nullable=False),
    Column("filename", Text, nullable=False),
    Column("file_type", String(16), nullable=False),
    Column("size_bytes", BigInteger, nullable=False, server_default="0"),
    Column("status", String(32), nullable=False, server_default=UPLOADED),
    Column("error_message", Text, nullable=True),
    Column("chunk_count", Integer, nullable=False, server_default="0"),
    # sha256 of the uploaded bytes: the same content uploaded to a base again is the same file.
    Column("content_hash", String(64), nullable=True),
    # Recorded error_parsing at upload (no supported type, empty, over the per-file limit): no
    # original was kept, so no task can parse it; it is deleted, not reindexed.
    Column("refused_at_upload", Boolean, nullable=False, server_default=false()),
    # The task that owns the row now; a pruned task leaves the file (and its last verdict) alone.
    Column("task_id", UUID(as_uuid=True), ForeignKey("tasks.id", ondelete="SET NULL"), nullable=True),
    # The attempt that moved it into its current in-progress state.
    Column("attempt_token", UUID(as_uuid=True), nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.clock_timestamp()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.clock_timestamp()),
    CheckConstraint(f"status IN {sql_in(STATUSES)}", name="status"),
    CheckConstraint(f"file_type IN {sql_in(FILE_TYPES)}", name="file_type"),
    CheckConstraint(
        f"status NOT IN {sql_in(ATTEMPT_BOUND)} OR (task_id IS NOT NULL AND attempt_token IS NOT NULL)",
        name="owned_in_progress",
    ),
)
# A base's listing, newest first, keyset-paged; and the hook's "files this task still owns".
Index(
    "ix_knowledge_files_kb_created",
    knowledge_files.c.kb_id,
    knowledge_files.c.created_at,
    knowledge_files.c.file_id,
)
Index("ix_knowledge_files_task", knowledge_files.c.task_id)
# One file per content in a base; concurrent uploads of the same bytes race on this, not on a read.
Index("uq_knowledge_files_kb_hash", knowledge_files.c.kb_id, knowledge_files.c.content_hash, unique=True)

# The texts search answers with. Milvus holds their vectors under the same chunk_id; a vector
# whose chunk row is gone (a deleted file, a crashed attempt's leftovers) never reaches a user.
knowledge_chunks = Table(
    "knowledge_chunks",
    metadata,
    Column("chunk_id", String(128), primary_key=True),
    Column("file_id", String(64), ForeignKey("knowledge_files.file_id", ondelete="CASCADE"), nullable=False),
    Column("seq", Integer, nullable=False),
    Column("text", Text, nullable=False),
    Column("attempt_token", UUID(as_uuid=True), nullable=False),
)
Index("ix_knowledge_chunks_file", knowledge_chunks.c.file_id, knowledge_chunks.c.seq)
