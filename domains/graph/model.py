"""A base's knowledge graph in PostgreSQL: one row per build, its entities and weighted edges.

A build writes only rows keyed by its own ``build_id``; readers see the base's newest ``built``
build, so a rebuild never shows a half-made graph. ``cursor_file``/``cursor_seq`` is the build's
checkpoint (the last chunk whose entities and edges are counted); it moves in the same owning
transaction as the counts it covers, so a retried attempt resumes where the last committed batch
ended.
"""

from __future__ import annotations

from sqlalchemy import (
    CheckConstraint,
    Column,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    func,
)
from sqlalchemy.dialects.postgresql import UUID

from tasks_core.model import metadata

BUILDING = "building"
BUILT = "built"
FAILED = "failed"
CANCELLED = "cancelled"
STATUSES = (BUILDING, BUILT, FAILED, CANCELLED)

graph_builds = Table(
    "graph_builds",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True),
    Column("base_id", String(64), ForeignKey("knowledge_bases.id", ondelete="CASCADE"), nullable=False),
    Column("status", String(16), nullable=False, server_default=BUILDING),
    # The task that builds it; a pruned task leaves the build (and its verdict) alone.
    Column("task_id", UUID(as_uuid=True), ForeignKey("tasks.id", ondelete="SET NULL"), nullable=True),
    # The attempt that last took the build on (a retry takes it over under a new token).
    Column("attempt_token", UUID(as_uuid=True), nullable=True),
    # The extractor its first attempt used (a retry must use the same).
    Column("extractor", Text, nullable=True),
    # Checkpoint: chunks are read in (file_id, seq) order; everything up to here is counted.
    Column("cursor_file", String(64), nullable=True),
    Column("cursor_seq", Integer, nullable=True),
    Column("chunks_done", Integer, nullable=False, server_default="0"),
    Column("chunk_total", Integer, nullable=True),
    Column("entity_count", Integer, nullable=True),
    Column("edge_count", Integer, nullable=True),
    Column("error_message", Text, nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.clock_timestamp()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.clock_timestamp()),
    Column("finished_at", DateTime(timezone=True), nullable=True),
    CheckConstraint("status IN ('building', 'built', 'failed', 'cancelled')", name="status"),
)
# The base's newest build of a status (the graph readers see; the one a route reports).
Index("ix_graph_builds_base", graph_builds.c.base_id, graph_builds.c.status, graph_builds.c.created_at)
Index("ix_graph_builds_task", graph_builds.c.task_id)

graph_entities = Table(
    "graph_entities",
    metadata,
    Column("build_id", UUID(as_uuid=True), ForeignKey("graph_builds.id", ondelete="CASCADE"), nullable=False),
    Column("name", Text, nullable=False),
    # Occurrences in all chunks, and the number of chunks it occurs in.
    Column("mentions", Integer, nullable=False),
    Column("chunks", Integer, nullable=False),
    PrimaryKeyConstraint("build_id", "name", name="pk_graph_entities"),
)
# Entity pages: most mentioned first.
Index(
    "ix_graph_entities_rank",
    graph_entities.c.build_id,
    graph_entities.c.mentions.desc(),
    graph_entities.c.name,
)

# An undirected edge is stored once, source < target; weight = chunks both occur in.
graph_edges = Table(
    "graph_edges",
    metadata,
    Column("build_id", UUID(as_uuid=True), ForeignKey("graph_builds.id", ondelete="CASCADE"), nullable=False),
    Column("source", Text, nullable=False),
    Column("target", Text, nullable=False),
    Column("weight", Integer, nullable=False),
    PrimaryKeyConstraint("build_id", "source", "target", name="pk_graph_edges"),
    CheckConstraint("source < target", name="ordered"),
)
# Neighbours of an entity that is the edge's target (the primary key serves the source side).
Index("ix_graph_edges_target", graph_edges.c.build_id, graph_edges.c.target)
