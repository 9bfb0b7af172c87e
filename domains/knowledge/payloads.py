"""Payload models of the knowledge task types (light: the API checks submissions against them)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

Id = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$", description="32 hex digits")]


class IngestPayload(BaseModel):
    """Parse and index one uploaded file (the upload route submits these)."""

    model_config = ConfigDict(extra="forbid")

    file_id: Id


class ReindexPayload(BaseModel):
    """One file again, or every file of a base that the reindex-pending route handed to the task."""

    model_config = ConfigDict(extra="forbid")

    file_id: Id | None = None
    base_id: Id | None = None

    @model_validator(mode="after")
    def _one_target(self) -> ReindexPayload:
        if (self.file_id is None) == (self.base_id is None):
            raise ValueError("give exactly one of file_id and base_id")
        return self
