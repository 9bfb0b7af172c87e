"""Request and response bodies of the /knowledge routes (they are the OpenAPI document)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field

NO_NUL = r"^[^\x00]*$"
ID = r"^[0-9a-f]{32}$"
FileStatus = Literal[
    "uploaded", "parsing", "parsed", "indexing", "indexed", "error_parsing", "error_indexing"
]


class BaseIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(min_length=1, max_length=200, pattern=NO_NUL, examples=["handbook"])]


class BaseOut(BaseModel):
    id: str
    name: str
    embedder: str = Field(description="The embedder the base's vectors come from")
    dimension: int
    created_at: datetime
    file_counts: dict[str, int] = Field(default_factory=dict, description="Files by status")


class BaseList(BaseModel):
    items: list[BaseOut]


class FileRef(BaseModel):
    id: str
    task_id: UUID | None
    status: FileStatus
    filename: str


class UploadOut(BaseModel):
    files: list[FileRef]
    published: bool = Field(
        description="False: stored, but the broker could not be reached; the publisher sends the tasks later"
    )


class FileOut(BaseModel):
    id: str
    base_id: str
    filename: str
    file_type: str
    size_bytes: int
    status: FileStatus
    error_message: str | None
    chunk_count: int
    task_id: UUID | None
    created_at: datetime
    updated_at: datetime


class FilePage(BaseModel):
    items: list[FileOut]
    next_cursor: str | None


class ReindexOut(BaseModel):
    task_id: UUID | None = Field(description="None when no file needed it")
    files: list[FileRef]


class SearchIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: Annotated[str, Field(min_length=1, max_length=4000, pattern=NO_NUL)]
    top_k: Annotated[int, Field(ge=1, le=100, strict=True)] = 5


class Hit(BaseModel):
    chunk_id: str
    file_id: str
    text: str
    score: float


class SearchOut(BaseModel):
    hits: list[Hit]


class Message(BaseModel):
    detail: str


class Conflict(BaseModel):
    detail: str
    task_id: UUID | None = None
