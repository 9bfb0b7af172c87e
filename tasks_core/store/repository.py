"""The task store under its former name: ``TaskRepository`` is ``TaskStore`` (tasks_core.store.facade),
and the names callers import from here stay importable while they move to the store's modules."""

from __future__ import annotations

from tasks_core.store.base import finished as _finished
from tasks_core.store.base import runnable_arrays as _runnable_arrays
from tasks_core.store.base import type_caps as _type_caps
from tasks_core.store.execute import Row, Rows, Statement
from tasks_core.store.execute import plain_row as _plain_row
from tasks_core.store.execute import plain_uuid as _plain_uuid
from tasks_core.store.facade import TaskStore
from tasks_core.store.maintenance import INTERRUPTED_MESSAGE
from tasks_core.store.outcomes import (
    Claim,
    ClaimRefusal,
    Finished,
    Heartbeat,
    HookFailed,
    HookSource,
    Inserted,
    NewTask,
    OwnershipLost,
    ReconcileReport,
    Refused,
    RelayOptions,
    RunnableSource,
    WaitingFacts,
)
from tasks_core.store.reads import decode_cursor, encode_cursor
from tasks_core.store.statements import (
    ACTIVE_SQL,
    CLAIM_SQL,
    DEDUPE_HOLDER_SQL,
    FINISH_SQL,
    IDEMPOTENCY_TTL_SECONDS,
    INSERT_MANY_SQL,
    INSERT_SQL,
    LOCK_NOT_AVAILABLE,
    NOW,
    ORPHAN_SLOT,
    OWNED,
    OWNER_UNDER_LIMIT,
    PUBLISH_DUE_SQL,
    RELAY_DUE_SQL,
    TERMINAL_SQL,
    UNPUBLISH_SQL,
    WAITING_COUNT_CAP,
    waiting_facts_sql,
)

TaskRepository = TaskStore

__all__ = [
    "ACTIVE_SQL",
    "CLAIM_SQL",
    "DEDUPE_HOLDER_SQL",
    "FINISH_SQL",
    "IDEMPOTENCY_TTL_SECONDS",
    "INSERT_MANY_SQL",
    "INSERT_SQL",
    "INTERRUPTED_MESSAGE",
    "LOCK_NOT_AVAILABLE",
    "NOW",
    "ORPHAN_SLOT",
    "OWNED",
    "OWNER_UNDER_LIMIT",
    "PUBLISH_DUE_SQL",
    "RELAY_DUE_SQL",
    "TERMINAL_SQL",
    "UNPUBLISH_SQL",
    "WAITING_COUNT_CAP",
    "Claim",
    "ClaimRefusal",
    "Finished",
    "Heartbeat",
    "HookFailed",
    "HookSource",
    "Inserted",
    "NewTask",
    "OwnershipLost",
    "ReconcileReport",
    "Refused",
    "RelayOptions",
    "Row",
    "Rows",
    "RunnableSource",
    "Statement",
    "TaskRepository",
    "TaskStore",
    "WaitingFacts",
    "_finished",
    "_plain_row",
    "_plain_uuid",
    "_runnable_arrays",
    "_type_caps",
    "decode_cursor",
    "encode_cursor",
    "waiting_facts_sql",
]
