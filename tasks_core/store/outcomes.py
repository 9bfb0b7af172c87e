"""What the task store takes and answers: its values, typed outcomes and errors."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, Protocol

from tasks_core.model import Status
from tasks_core.store.execute import Row


class OwnershipLost(Exception):
    """The attempt's lease lapsed, its token was replaced, or the task is no longer running."""


class HookFailed(Exception):
    """A domain hook raised inside the terminal transaction (rolled back). Its cause is the hook's
    exception; a transient database error under it is re-raised as itself instead."""


class HookSource(Protocol):
    def hook_for(self, task_type: str, version: int, kind: Any) -> Any: ...


class RunnableSource(HookSource, Protocol):
    def runnable(self, task_type: str, version: int) -> Any: ...

    def __contains__(self, task_type: object) -> bool: ...


@dataclass(frozen=True)
class NewTask:
    task_type: str
    handler_version: int
    payload: dict[str, Any]
    timeout_seconds: float
    dedupe_key: str | None = None
    owner: str | None = None
    # Claimable from this instant on (aware), or this many seconds after PostgreSQL's now at
    # insert; at most one of the two.
    run_at: datetime | None = None
    delay_seconds: float | None = None
    priority: int = 0
    # The failed or cancelled task this one retries by hand.
    retry_of: uuid.UUID | None = None


@dataclass(frozen=True)
class Inserted:
    id: uuid.UUID
    # Set when an active task already holds the dedupe key: that task's id.
    duplicate_of: uuid.UUID | None = None
    # The stored row, as inserted (None for a duplicate).
    row: Row | None = None


@dataclass(frozen=True)
class Claim:
    task: Row
    token: uuid.UUID
    attempt: int


class ClaimRefusal(StrEnum):
    """Why a claim took nothing (the metric's label)."""

    UNKNOWN_TASK = "unknown_task"
    NOT_PENDING = "not_pending"
    NOT_RUNNABLE = "not_runnable"
    CANCEL_REQUESTED = "cancel_requested"
    BACKOFF = "backoff"
    # An operator paused the task's type (POST /task-types/{type}/pause).
    TYPE_PAUSED = "type_paused"
    OWNER_LIMIT = "owner_limit"
    # Slot rows removed or left held behind the runtime's back: the claim repairs them and retries.
    SLOTS_MISSING = "slots_missing"
    SLOTS_STALE = "slots_stale"
    # The cluster's capacity, or the type's (TaskSpec.concurrency).
    CAPACITY_FULL = "capacity_full"
    # The type's or owner's lock was not free within the claim's wait.
    CAPACITY_BUSY = "capacity_busy"


class Refused(str):
    """A refused claim: its ``reason``, and for ``not_pending`` the task's ``status``. As text it is
    what logs, run outcomes and callers have always seen: the reason, or ``not_pending:<status>``."""

    reason: ClaimRefusal
    status: Status | None

    def __new__(cls, reason: ClaimRefusal, status: Status | None = None) -> Refused:
        refused = super().__new__(cls, reason.value if status is None else f"{reason.value}:{status.value}")
        refused.reason, refused.status = reason, status
        return refused


@dataclass(frozen=True)
class RelayOptions:
    """What a terminal write hands on to the slot it frees: take_due's budget, with the relay's
    settings (capacity, ahead, window, limit, per-owner limit)."""

    registry: RunnableSource
    capacity: int
    ahead: int
    window: float
    limit: int
    owner_max_running: int | None = None


@dataclass(frozen=True)
class Finished:
    status: Status
    # Tasks the terminal write stamped as published for the freed slot: (id, type), oldest first,
    # to be sent by the caller now that the write committed.
    relay: list[tuple[uuid.UUID, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Heartbeat:
    owned: bool
    cancel_requested: bool = False


@dataclass(frozen=True)
class WaitingFacts:
    """What the database says about a pending task that is not running yet."""

    # Its not_before (run_at, or a retry's backoff) is still ahead.
    backoff: bool
    # Its type is paused.
    paused: bool
    # Tasks running in the cluster, and of the task's own owner.
    running: int
    mine_running: int
    # The owner's older pending tasks, counted up to one past the cap.
    ahead: int


@dataclass
class ReconcileReport:
    failed: int = 0
    retried: int = 0
    legacy: int = 0
    unrunnable: int = 0
    # Pending rows stranded with cancel intent (nothing would ever claim or publish them).
    cancelled: int = 0
    hook_errors: int = 0
    # Capacity slots held for a task that is no longer running under that token (only a change
    # made outside the runtime can leave one: every write that ends an attempt frees its slot).
    slots_freed: int = 0
    # Worker sessions ended for holding a transaction open longer than a lease (a stopped process).
    sessions_ended: int = 0
    errors: list[str] = field(default_factory=list)
