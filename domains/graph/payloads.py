"""Payload model of graph.build (light: the API checks submissions against it)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class BuildPayload(BaseModel):
    """Build (or rebuild) the knowledge graph of one base; the build row names the task."""

    model_config = ConfigDict(extra="forbid")

    base_id: str = Field(pattern=r"^[0-9a-f]{32}$", description="32 hex digits")
