"""Request and response bodies (they are the OpenAPI document)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field

# PostgreSQL text cannot hold U+0000: refuse it at the edge instead of failing in the database.
NO_NUL = r"^[^\x00]*$"

Status = Literal["pending", "running", "success", "failed", "cancelled"]


class TaskIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_type: Annotated[
        str, Field(min_length=1, max_length=200, pattern=NO_NUL, examples=["diagnostics.sleep"])
    ]
    payload: Annotated[dict[str, Any], Field(default_factory=dict, examples=[{"seconds": 10, "steps": 10}])]
    handler_version: Annotated[int | None, Field(strict=True, ge=0)] = None
    dedupe_key: Annotated[str | None, Field(min_length=1, pattern=NO_NUL)] = None
    timeout_seconds: Annotated[float | None, Field(gt=0, allow_inf_nan=False)] = None


class BatchIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tasks: Annotated[list[TaskIn], Field(min_length=1, max_length=1000)]


class TaskError(BaseModel):
    code: str
    message: str


class TaskOut(BaseModel):
    id: UUID
    task_type: str
    handler_version: int
    status: Status
    progress: float
    message: str | None
    result: Any = None
    error: TaskError | None
    attempt_count: int
    cancel_requested: bool
    dedupe_key: str | None
    timeout_seconds: float
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    lease_expires_at: datetime | None
    waiting_reason: str | None = Field(None, description="Why a pending task is not running yet")


class EntryError(BaseModel):
    code: Literal["invalid", "forbidden", "quota", "duplicate"]
    field: str | None = None
    message: str
    task_id: UUID | None = Field(None, description="The active task holding the dedupe key")


class BatchEntry(BaseModel):
    task: TaskOut | None = None
    error: EntryError | None = None


class BatchOut(BaseModel):
    results: list[BatchEntry]
    accepted: int
    published: bool


class TaskPage(BaseModel):
    items: list[TaskOut]
    next_cursor: str | None


class Summary(BaseModel):
    total: int
    by_status: dict[str, int]
    by_type: dict[str, dict[str, int]]
    age_seconds: float = Field(0.0, description="How long ago these exact counts were taken")


class Conflict(BaseModel):
    detail: str
    task_id: UUID | None = None


class Message(BaseModel):
    detail: str


class Fact(BaseModel):
    ok: bool
    detail: str | None = None


class Readiness(BaseModel):
    ready: bool
    facts: dict[str, Fact]


class TaskType(BaseModel):
    task_type: str
    version: int = Field(description="The handler version new tasks of this type get")
    default_timeout_seconds: float = Field(description="Used when a submission gives no timeout_seconds")
    retry_safe: bool = Field(description="Sent back to pending (with backoff) after a lost lease")
    max_attempts: int
    payload_schema: dict[str, Any] = Field(description="JSON Schema the payload is checked against")
