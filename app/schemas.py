"""Request and response bodies (they are the OpenAPI document)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal
from uuid import UUID

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from tasks_core.model import MAX_PRIORITY, MIN_PRIORITY

# PostgreSQL text cannot hold U+0000: refuse it at the edge instead of failing in the database.
NO_NUL = r"^[^\x00]*$"

Status = Literal["pending", "running", "success", "failed", "cancelled"]


def _d(text: str, **kw: Any) -> Any:
    return Field(description=text, **kw)


class TaskIn(BaseModel):
    """A task to run: its type, its payload (checked against the type's schema, see
    `GET /task-types`) and optional limits."""

    model_config = ConfigDict(extra="forbid")

    task_type: Annotated[
        str,
        _d("A registered task type (`GET /task-types`)", min_length=1, max_length=200, pattern=NO_NUL,
           examples=["diagnostics.sleep"]),
    ]
    payload: Annotated[
        dict[str, Any],
        _d("The handler's input, a JSON object of at most DTASK_MAX_PAYLOAD_BYTES",
           default_factory=dict, examples=[{"seconds": 10, "steps": 10}]),
    ]
    handler_version: Annotated[
        int | None, _d("Omit for the current version; any other version is refused", strict=True, ge=0)
    ] = None
    dedupe_key: Annotated[
        str | None,
        _d("At most one active (pending or running) task of yours per type and key: a duplicate is "
           "409 naming the holder", min_length=1, pattern=NO_NUL, examples=["nightly-2026-11-30"]),
    ] = None
    timeout_seconds: Annotated[
        float | None,
        _d("Ends the task failed (`timeout`) after this long; default: the type's, at most "
           "DTASK_MAX_TIMEOUT_SECONDS", gt=0, allow_inf_nan=False, examples=[3600]),
    ] = None
    run_at: Annotated[
        AwareDatetime | None,
        _d("Not run before this instant (RFC 3339 with a zone; PostgreSQL's clock decides); not with "
           "delay_seconds", examples=["2026-12-24T18:00:00Z"]),
    ] = None
    delay_seconds: Annotated[
        float | None,
        _d("Not run before this many seconds from now; not with run_at", ge=0, allow_inf_nan=False,
           examples=[600]),
    ] = None
    priority: Annotated[
        int,
        _d(f"Among runnable tasks the higher priority goes first, then the older ({MIN_PRIORITY} to "
           f"{MAX_PRIORITY})", strict=True, ge=MIN_PRIORITY, le=MAX_PRIORITY),
    ] = 0


class BatchIn(BaseModel):
    """Up to 1,000 tasks: the valid ones commit together; each invalid one is reported in place."""

    model_config = ConfigDict(extra="forbid")

    tasks: Annotated[list[TaskIn], _d("The tasks, in order", min_length=1, max_length=1000)]


class TaskError(BaseModel):
    code: str = _d("Machine-readable: handler_error, timeout, cancelled, lease_expired, "
                   "worker_shutdown, hook_failed, handler_unresponsive, …")
    message: str = _d("For people: the exception's class and first line, or the reason")


class TaskOut(BaseModel):
    """A task as PostgreSQL holds it."""

    id: UUID = _d("The task's id")
    task_type: str = _d("Its type")
    handler_version: int = _d("The handler version it runs with (0: from the pre-durable release)")
    status: Status = _d("pending → running → success | failed | cancelled")
    progress: float = _d("0-100, as the handler last reported it")
    message: str | None = _d("The handler's last progress message")
    result: Any = _d("What the handler returned (success only)", default=None)
    error: TaskError | None = _d("Why it failed or was cancelled")
    attempt_count: int = _d("How many times a worker claimed it")
    cancel_requested: bool = _d("Cancel intent is recorded (a running task stops at its next heartbeat)")
    dedupe_key: str | None = _d("Its dedupe key, if any")
    timeout_seconds: float = _d("Its timeout")
    created_at: datetime = _d("When it was submitted (PostgreSQL's clock)")
    started_at: datetime | None = _d("When a worker first claimed it")
    finished_at: datetime | None = _d("When it reached its terminal state")
    lease_expires_at: datetime | None = _d("While running: when its owner's lease lapses unless renewed")
    run_at: datetime | None = _d("The instant it was scheduled for (run_at or delay_seconds)", default=None)
    priority: int = _d("Higher runs first among runnable tasks", default=0)
    retry_of: UUID | None = _d("The failed or cancelled task this one retries by hand", default=None)
    retried_by: UUID | None = _d("The task that retried this one by hand", default=None)
    waiting_reason: str | None = _d("While pending: why it is not running yet", default=None)


class EntryError(BaseModel):
    code: Literal[
        "invalid", "forbidden", "quota", "duplicate", "idempotency_key_reused", "not_found", "retried",
        "not_retryable",
    ] = _d(
        "invalid (422), forbidden (403), quota (429) or duplicate (409) — what a single POST answers; "
        "for a retry also not_found (404), retried (409: already retried) and not_retryable (409: not "
        "failed or cancelled)"
    )
    field: str | None = _d("The offending field", default=None)
    message: str = _d("What is wrong")
    task_id: UUID | None = _d(
        "duplicate: your active task holding the dedupe key; retried: the task that retried it", default=None
    )


class BatchEntry(BaseModel):
    task: TaskOut | None = _d("The stored task", default=None)
    error: EntryError | None = _d("Why this entry was refused (nothing stored for it)", default=None)


class RetryIn(BaseModel):
    """Failed or cancelled tasks to submit again, each as a new task (one transaction)."""

    model_config = ConfigDict(extra="forbid")

    ids: Annotated[list[UUID], _d("The tasks, in order", min_length=1, max_length=1000)]


class AttemptOut(BaseModel):
    """One attempt: a claim of the task under its own token, and how it ended."""

    attempt: int = _d("1 for the first claim, then 2, …")
    worker: str | None = _d("The worker process that claimed it (`node:pid`)")
    claimed_at: datetime = _d("When it was claimed (PostgreSQL's clock)")
    ended_at: datetime | None = _d("When its ownership ended: its terminal write, or its lapsed lease")
    outcome: str | None = _d("success, failed, cancelled, lease_expired, worker_shutdown, … (null: running)")
    error: str | None = _d("Why it ended, if not success: the error's first line (admin keys: all of it)")


class RetryOut(BaseModel):
    results: list[BatchEntry] = _d("One per id, in order: the new task, or why not")
    accepted: int = _d("Tasks retried")


class AttemptList(BaseModel):
    items: list[AttemptOut] = _d("Every attempt, first first")


class BatchOut(BaseModel):
    results: list[BatchEntry] = _d("One per submitted entry, in order")
    accepted: int = _d("Entries stored")
    published: bool = _d(
        "False if the broker could not be reached (the tasks wait, pending, for the publisher); "
        "true when the tasks went out or wait only for a free slot"
    )


class TaskPage(BaseModel):
    items: list[TaskOut] = _d("Newest first")
    next_cursor: str | None = _d("Pass back as `cursor` for the next page; null on the last")


class Summary(BaseModel):
    total: int = _d("All tasks counted")
    by_status: dict[str, int] = _d("Counts by status (every status present, 0 included)")
    by_type: dict[str, dict[str, int]] = _d("Counts by type, then status")
    age_seconds: float = _d("How long ago these exact counts were taken", default=0.0)


class Conflict(BaseModel):
    detail: str = _d("What happened")
    task_id: UUID | None = _d("Your active task holding the dedupe key", default=None)


class Message(BaseModel):
    detail: str = _d("What happened")


class Fact(BaseModel):
    ok: bool = _d("Whether this fact holds")
    detail: str | None = _d("Why not (never internals: those are in the api log)", default=None)


class Readiness(BaseModel):
    ready: bool = _d("Every fact holds")
    facts: dict[str, Fact] = _d("postgres, redis, readiness (a worker reconciled recently)")


class TaskType(BaseModel):
    task_type: str = _d("The type's name")
    version: int = _d("The handler version new tasks of this type get")
    default_timeout_seconds: float = _d("Used when a submission gives no timeout_seconds")
    retry_safe: bool = _d("Sent back to pending (with backoff) after a lost lease or a worker shutdown")
    max_attempts: int = _d("Attempts in all (more than 1 only for retry-safe types)")
    internal: bool = _d("Made by its domain's own routes with the rows it works on; POST /tasks refuses it")
    paused: bool = _d("An operator paused it: its pending tasks wait (`type paused`), running ones finish")
    payload_schema: dict[str, Any] = _d("JSON Schema the payload is checked against")
