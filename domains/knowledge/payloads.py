"""Payload models of the knowledge task types (light: the API checks submissions against them)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

Id = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$", description="32 hex digits")]


# Files one ingest task may hold (the upload groups a request's small files into such tasks).
MAX_INGEST_FILES = 1000


class IngestPayload(BaseModel):
    """Parse and index uploaded files (the upload route submits these): one (``file_id``, as every
    upload did before uploads grouped files), or several of one request (``file_ids``)."""

    model_config = ConfigDict(extra="forbid")

    file_id: Id | None = None
    file_ids: Annotated[list[Id], Field(min_length=1, max_length=MAX_INGEST_FILES)] | None = None

    @model_validator(mode="after")
    def _one_form(self) -> IngestPayload:
        if (self.file_id is None) == (self.file_ids is None):
            raise ValueError("give exactly one of file_id and file_ids")
        return self


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
