"""Request and response bodies of the /graph routes (they are the OpenAPI document)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal
from uuid import UUID

from pydantic import BaseModel, Field

BuildStatus = Literal["building", "built", "failed", "cancelled"]


class BuildRef(BaseModel):
    build_id: UUID = Field(description="The build (the graph it makes, once built)")
    task_id: UUID = Field(description="Its graph.build task: follow it at GET /tasks/{id}")
    status: BuildStatus = Field(description="building until its task ends: built, failed or cancelled")
    deduplicated: bool = Field(
        description="True when a build of this base was already under way: this is that build and task"
    )


class BuildOut(BaseModel):
    id: UUID = Field(description="The build")
    base_id: str = Field(description="The knowledge base it was built from")
    status: BuildStatus = Field(description="building until its task ends: built, failed or cancelled")
    task_id: UUID | None = Field(description="Its task (null once the task was pruned)")
    extractor: str | None = Field(description="The entity extractor it ran with")
    chunks_done: int = Field(description="Chunks counted so far (checkpointed per batch)")
    chunk_total: int | None = Field(description="Chunks of the base's indexed files when it started")
    entity_count: int | None = Field(description="Entities in the graph (once built)")
    edge_count: int | None = Field(description="Edges in the graph (once built)")
    error_message: str | None = Field(description="Why it failed or was cancelled")
    created_at: datetime = Field(description="When it was requested (database clock)")
    finished_at: datetime | None = Field(description="When its task ended (null: still building)")


class GraphOut(BaseModel):
    base_id: str = Field(description="The knowledge base")
    graph: BuildOut | None = Field(description="The build readers see: the newest built one (null: none yet)")
    latest: BuildOut | None = Field(description="The newest build of any status (null: never built)")


class Entity(BaseModel):
    name: str = Field(description="The entity as extracted")
    mentions: int = Field(description="Occurrences in all chunks")
    chunks: int = Field(description="Chunks it occurs in")


class EntityPage(BaseModel):
    build_id: UUID = Field(description="The build the page comes from")
    items: list[Entity] = Field(description="Most mentioned first, then by name")
    next_cursor: str | None = Field(description="Pass back as `cursor` for the next page (null: last page)")


class Neighbor(BaseModel):
    name: str = Field(description="The neighbouring entity")
    weight: int = Field(description="Chunks it shares with the entity")
    mentions: int = Field(description="Its own occurrences in all chunks")


class NeighborsOut(BaseModel):
    build_id: UUID = Field(description="The build the answer comes from")
    entity: Entity = Field(description="The entity asked about")
    neighbors: list[Neighbor] = Field(description="Heaviest edge first, then by name")


class GraphError(BaseModel):
    detail: str = Field(description="What was wrong, in one sentence")
