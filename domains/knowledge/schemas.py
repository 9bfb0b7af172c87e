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
STATUS_HELP = (
    "uploaded → parsing → parsed → indexing → indexed; error_parsing or error_indexing when it cannot "
    "go on (error_message says why; reindex to try again). A file of no supported type, an empty one "
    "or one over the per-file limit is error_parsing from its upload on, with no task"
)


class BaseIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[
        str,
        Field(
            min_length=1,
            max_length=200,
            pattern=NO_NUL,
            examples=["handbook"],
            description="A name for the base, unique among your bases",
        ),
    ]


class BaseOut(BaseModel):
    id: str = Field(
        description="The base's id (32 hex digits)", examples=["3f1c0e9a5b7d4e2f8a6c1b0d9e8f7a6b"]
    )
    name: str = Field(description="Its name, unique among the owner's bases")
    embedder: str = Field(description="The embedder its vectors come from (search and indexing must use it)")
    dimension: int = Field(description="Length of its vectors")
    created_at: datetime = Field(description="When it was created (PostgreSQL's clock)")
    file_counts: dict[str, int] = Field(default_factory=dict, description="Its files, counted by status")


class BaseList(BaseModel):
    items: list[BaseOut] = Field(description="Your bases (all of them with an admin key), newest first")


class FileRef(BaseModel):
    id: str = Field(description="The file's id (32 hex digits)")
    task_id: UUID | None = Field(description="The task that works on it now: follow it at GET /tasks/{id}")
    status: FileStatus = Field(description=STATUS_HELP)
    filename: str = Field(description="The uploaded file's name (without its folders)")
    error_message: str | None = Field(
        None, description="Why an uploaded file was not kept for parsing (it is error_parsing at once)"
    )
    duplicate_of: str | None = Field(
        None,
        description=(
            "The base already has a file of exactly these bytes (sha256): this entry is that file, "
            "nothing was stored or indexed again. To replace a file, delete it, then upload"
        ),
    )


class UploadOut(BaseModel):
    files: list[FileRef] = Field(description="One entry per uploaded file, in the order they were sent")
    published: bool = Field(
        description="False: stored, but the broker could not be reached; the publisher sends the tasks later"
    )


class FileOut(BaseModel):
    id: str = Field(description="The file's id (32 hex digits)")
    base_id: str = Field(description="The base it belongs to")
    filename: str = Field(description="The uploaded file's name (without its folders)")
    file_type: str = Field(
        description=(
            "txt, md, html, pdf, rst, docx, csv or json (from the name's extension); other: none of them"
        )
    )
    size_bytes: int = Field(description="Size of the original, in bytes")
    status: FileStatus = Field(description=STATUS_HELP)
    error_message: str | None = Field(description="Why it ended in an error state (None otherwise)")
    chunk_count: int = Field(description="Chunks indexed from it (0 until it is indexed)")
    task_id: UUID | None = Field(description="The task that owns it now, or the last one that did")
    attempt: int | None = Field(
        None,
        description=(
            "While it is in progress: the attempt of its task that runs it (or, while the task waits, "
            "the one that will); None otherwise"
        ),
    )
    max_attempts: int | None = Field(
        None, description="While it is in progress: how many attempts its task may have in all"
    )
    content_hash: str | None = Field(
        None, description="sha256 (hex) of the original; None for a file refused at upload"
    )
    created_at: datetime = Field(description="When it was uploaded (PostgreSQL's clock)")
    updated_at: datetime = Field(description="When its status last changed (PostgreSQL's clock)")


class FilePage(BaseModel):
    items: list[FileOut] = Field(description="One page of the base's files, newest first")
    next_cursor: str | None = Field(
        description="Pass it back as `cursor` for the next page (None: last page)"
    )


class ReindexOut(BaseModel):
    task_id: UUID | None = Field(description="The reindex task (None when no file needed it)")
    files: list[FileRef] = Field(description="The files handed to that task")


class SearchIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: Annotated[
        str,
        Field(
            min_length=1,
            max_length=4000,
            pattern=NO_NUL,
            examples=["how do I request leave"],
            description="What to look for, in words",
        ),
    ]
    top_k: Annotated[int, Field(ge=1, le=100, strict=True, description="How many chunks to return")] = 5
    min_score: Annotated[
        float | None,
        Field(
            ge=-1,
            le=1,
            allow_inf_nan=False,
            strict=True,
            description="Only chunks at least this similar (cosine, -1 to 1); None: no floor",
        ),
    ] = None


class Hit(BaseModel):
    chunk_id: str = Field(description="The chunk's id: `<file_id>-<n>`")
    file_id: str = Field(description="The file it comes from")
    filename: str = Field(description="That file's name")
    text: str = Field(description="The chunk's text")
    score: float = Field(description="Cosine similarity to the query (higher is closer)")


class SearchOut(BaseModel):
    hits: list[Hit] = Field(
        description=(
            "The closest chunks of the base's indexed files, best first; one per text (a text that "
            "several files hold is shown once, with its best score)"
        )
    )


class KnowledgeError(BaseModel):
    detail: str = Field(description="What went wrong, in words")


class KnowledgeConflict(BaseModel):
    detail: str = Field(description="What is in the way")
    task_id: UUID | None = Field(None, description="The active task that holds the file or base")
