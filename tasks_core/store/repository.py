"""All SQL that touches the task row and its attempts, in one place.

Every time comes from PostgreSQL (``clock_timestamp()``), never from a worker (I7). Tests may pin
"now" by setting ``TaskRepository.now``; it replaces ``clock_timestamp()`` in every statement.

Fencing: a write by an attempt carries ``attempt_token = :tok AND status = 'running' AND
lease_expires_at > now``; zero rows means the attempt no longer owns the task (I2).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql.elements import TextClause
from sqlalchemy.util import greenlet_spawn

from tasks_core.db import is_transient
from tasks_core.model import LEGACY_VERSION, Status

log = logging.getLogger(__name__)

NOW = "coalesce(CAST(:now AS timestamptz), clock_timestamp())"
OWNED = f"attempt_token = :tok AND status = 'running' AND lease_expires_at > {NOW}"
# SQLSTATE lock_not_available: raised when lock_timeout expires.
LOCK_NOT_AVAILABLE = "55P03"
ACTIVE_SQL = "('pending', 'running')"
# Why a pre-durable task that was pending or running ends failed (`legacy_interrupted`).
INTERRUPTED_MESSAGE = "interrupted by the upgrade from the pre-durable release; resubmit to run it again"
TERMINAL_SQL = "('success', 'failed', 'cancelled')"


def _owner_under_limit(ending: str | None = None) -> str:
    """The row's owner runs fewer than :omax tasks (no limit when :omax is NULL; tasks without an
    owner, submitted through the Python API, are exempt). Evaluated on `tasks` rows (claim, relay,
    publisher). ``ending``: a CTE of rows this same statement takes out of running, which its
    snapshot still counts (the terminal write's relay: its own finishing task)."""
    running = "(SELECT count(*) FROM tasks mine WHERE mine.status = 'running' AND mine.owner = tasks.owner)"
    if ending is not None:
        running += f" - (SELECT count(*) FROM {ending} WHERE {ending}.owner = tasks.owner)"
    return f"""(CAST(:omax AS int) IS NULL OR tasks.owner IS NULL
    OR {running} < CAST(:omax AS int))"""


OWNER_UNDER_LIMIT = _owner_under_limit()
# An Idempotency-Key answers retries for this long (design §8: 24 h).
IDEMPOTENCY_TTL_SECONDS = 24 * 3600
class Statement:
    """A hot-path statement sent through the pooled connection's asyncpg driver itself.

    The same SQL as ``text()`` (named parameters), bound positionally and prepared once per
    connection by asyncpg. It skips SQLAlchemy's per-execution work (result metadata, processors,
    greenlet hops): about 0.3 ms of worker CPU per call, three calls per task (docs/benchmarks.md).
    ``clause`` is the SQLAlchemy form, for callers inside a transaction of their own.
    """

    def __init__(self, clause: TextClause) -> None:
        self.clause = clause
        self.names: list[str] = []

        def positional(match: re.Match[str]) -> str:
            if match.group(1) not in self.names:
                self.names.append(match.group(1))
            return f"${self.names.index(match.group(1)) + 1}"

        # `:name`, not `::type` (a cast) and not inside a word.
        self.query = re.sub(r"(?<![:\w]):([A-Za-z_]\w*)", positional, clause.text)

    @property
    def text(self) -> str:
        return self.clause.text

    def args(self, params: Mapping[str, Any]) -> list[Any]:
        return [params[name] for name in self.names]


def _due_ctes(freed: str = "0", *, ending: str | None = None, republish: bool = False) -> str:
    """`budget` and `due`: the oldest runnable pending tasks capacity can take now (see take_due),
    locked for stamping. ``freed``: slots this same statement gives back, which its snapshot still
    sees as held; ``ending``: the CTE of the task(s) it ends, which its snapshot still sees running
    for their owner. Without ``republish`` only tasks with no message in flight are due (the relay's
    case, which ix_tasks_unpublished serves whatever the plan); with it also those published
    longer than ``:after`` seconds ago (the publisher's)."""
    unsent = "last_published_at IS NULL"
    if republish:
        unsent = f"({unsent} OR last_published_at < {NOW} - make_interval(secs => :after))"
    return f"""budget AS (
        SELECT CASE WHEN CAST(:cap AS int) IS NULL THEN CAST(:limit AS int) ELSE
            CAST(:cap AS int) + CAST(:ahead AS int) + ({freed})
            - (SELECT count(*) FROM task_slots WHERE task_id IS NOT NULL)
            - (SELECT count(*) FROM (
                  SELECT 1 FROM tasks WHERE status = 'pending'
                    AND last_published_at > {NOW} - make_interval(secs => :window)
                  LIMIT CAST(:cap AS int) + CAST(:ahead AS int)) flight) END AS n),
    due AS (
        SELECT id FROM tasks
        WHERE status = 'pending' AND cancel_requested_at IS NULL
          AND (not_before IS NULL OR not_before <= {NOW})
          AND {unsent}
          AND (task_type, handler_version) IN (
              SELECT * FROM unnest(CAST(:types AS text[]), CAST(:versions AS int[])))
          AND {_owner_under_limit(ending)}
        ORDER BY created_at, id
        LIMIT least(CAST(:limit AS int), greatest(0, (SELECT n FROM budget)))
        FOR UPDATE SKIP LOCKED)"""


# The claim, in one statement: a free slot below the capacity (skipping slots other claimers hold),
# the task marked running under the new token only if it is still pending, wanted, due and of a
# runnable type and version (and, on the locked path, under its type's cap and owner's limit), the
# slot taken, the attempt recorded. No slot, or no longer pending: nothing changes. A claim of a
# task that is not pending (a late or duplicate message) locks no slot at all: locked, that slot
# would be skipped by a concurrent claim of a pending task, refused `capacity_full` with a slot free.
CLAIM_SQL = Statement(text(
    f"""WITH slot AS (
        SELECT slot FROM task_slots WHERE slot < :cap AND task_id IS NULL
          AND EXISTS (SELECT 1 FROM tasks WHERE id = :id AND status = 'pending'
                      AND cancel_requested_at IS NULL)
        ORDER BY slot LIMIT 1 FOR UPDATE SKIP LOCKED),
    claimed AS (
        UPDATE tasks SET status = 'running', attempt_token = :tok, attempt_count = attempt_count + 1,
               lease_expires_at = {NOW} + make_interval(secs => :lease), heartbeat_at = {NOW},
               started_at = coalesce(started_at, {NOW}), not_before = NULL
        WHERE id = :id AND status = 'pending' AND cancel_requested_at IS NULL
          AND (not_before IS NULL OR not_before <= {NOW})
          AND (task_type, handler_version) IN (
              SELECT * FROM unnest(CAST(:types AS text[]), CAST(:versions AS int[])))
          AND EXISTS (SELECT 1 FROM slot)
          AND NOT EXISTS (
              SELECT 1 FROM unnest(CAST(:ctypes AS text[]), CAST(:ccaps AS int[])) AS c(task_type, cap)
              WHERE c.task_type = tasks.task_type
                AND (SELECT count(*) FROM tasks mine WHERE mine.status = 'running'
                     AND mine.task_type = c.task_type) >= c.cap)
          AND {OWNER_UNDER_LIMIT}
        RETURNING *),
    taken AS (
        UPDATE task_slots SET task_id = claimed.id, token = claimed.attempt_token
        FROM slot, claimed WHERE task_slots.slot = slot.slot),
    attempt AS (
        INSERT INTO task_attempts (task_id, attempt, token, worker, claimed_at)
        SELECT id, attempt_count, attempt_token, :worker, heartbeat_at FROM claimed)
    SELECT * FROM claimed"""
))
# The owner's terminal statement: fenced like every owner write; cancel intent turns a success into
# `cancelled`; the attempt is recorded as ended and the capacity slot given back in the same statement
# (the status change also frees the dedupe key). It also does the relay's work: the freed slot's
# next tasks are stamped as published and returned (relay_ids, relay_types) for the caller to send
# after commit — one statement per task fewer than a separate relay (`:limit` 0: none).
FINISH_SQL = Statement(text(
    f"""WITH prior AS (
        SELECT id, lease_expires_at FROM tasks WHERE id = :id AND {OWNED} FOR UPDATE),
    done AS (
        UPDATE tasks SET
            status = CASE WHEN :status = 'success' AND cancel_requested_at IS NOT NULL
                          THEN 'cancelled' ELSE :status END,
            result = CASE WHEN :status = 'success' AND cancel_requested_at IS NULL
                          THEN CAST(:result AS jsonb) END,
            error = CASE WHEN :status = 'success' AND cancel_requested_at IS NOT NULL
                         THEN CAST(:cancelled AS jsonb) ELSE CAST(:error AS jsonb) END,
            progress = CASE WHEN :status = 'success' AND cancel_requested_at IS NULL THEN 100
                            ELSE progress END,
            finished_at = {NOW}, attempt_token = NULL, lease_expires_at = NULL
        FROM prior WHERE tasks.id = prior.id
        RETURNING tasks.*, prior.lease_expires_at AS lease_was),
    ended AS (
        UPDATE task_attempts SET ended_at = {NOW}, detail = :detail,
               outcome = CASE WHEN done.status = 'cancelled' AND :status = 'success'
                              THEN 'cancelled' ELSE :outcome END
        FROM done WHERE task_attempts.token = :tok AND task_attempts.ended_at IS NULL),
    freed AS (
        UPDATE task_slots SET task_id = NULL, token = NULL FROM done WHERE task_slots.task_id = done.id),
    {_due_ctes(freed="SELECT count(*) FROM done", ending="done")},
    relayed AS (
        UPDATE tasks t SET last_published_at = {NOW}, publish_error = NULL
        FROM due WHERE t.id = due.id AND EXISTS (SELECT 1 FROM done)
        RETURNING t.id, t.created_at, t.task_type)
    SELECT done.*,
        (SELECT array_agg(id ORDER BY created_at, id) FROM relayed) AS relay_ids,
        (SELECT array_agg(task_type ORDER BY created_at, id) FROM relayed) AS relay_types
    FROM done"""
))
# What the relay and a submission send (RELAY_DUE_SQL), and the publisher (PUBLISH_DUE_SQL: also
# what was sent long ago), in one statement each (see take_due).
_STAMP_DUE = f"""UPDATE tasks t SET last_published_at = {NOW}, publish_error = NULL
    FROM due WHERE t.id = due.id
    RETURNING t.id, t.created_at, t.task_type"""
RELAY_DUE_SQL = Statement(text(f"WITH {_due_ctes()}\n    {_STAMP_DUE}"))
PUBLISH_DUE_SQL = Statement(text(f"WITH {_due_ctes(republish=True)}\n    {_STAMP_DUE}"))
# A submission's insert (one row, or many in order); a held dedupe key inserts nothing, and the
# holder is looked up. Built once: a text() per call cost a submission 2% of the api's CPU.
_ON_HELD_KEY = f"""ON CONFLICT (owner, task_type, dedupe_key)
        WHERE status IN {ACTIVE_SQL} AND dedupe_key IS NOT NULL
    DO NOTHING RETURNING *"""
INSERT_SQL = text(
    f"""INSERT INTO tasks (id, task_type, handler_version, payload, owner, status, dedupe_key,
                       timeout_seconds, created_at)
    VALUES (:id, :tt, :hv, CAST(:payload AS jsonb), :owner, 'pending', :dk, :timeout, {NOW})
    {_ON_HELD_KEY}"""
)
INSERT_MANY_SQL = text(
    f"""INSERT INTO tasks (id, task_type, handler_version, payload, owner, status, dedupe_key,
                       timeout_seconds, created_at)
    SELECT id, task_type, hv, CAST(payload AS jsonb), owner, 'pending', key, timeout, {NOW}
    FROM unnest(CAST(:ids AS uuid[]), CAST(:types AS text[]), CAST(:versions AS int[]),
                CAST(:payloads AS text[]), CAST(:owners AS text[]), CAST(:keys AS text[]),
                CAST(:timeouts AS float8[]))
         WITH ORDINALITY AS n(id, task_type, hv, payload, owner, key, timeout, ord)
    ORDER BY ord
    {_ON_HELD_KEY}"""
)
DEDUPE_HOLDER_SQL = text(
    f"""SELECT id FROM tasks WHERE owner IS NOT DISTINCT FROM :owner
    AND task_type = :tt AND dedupe_key = :dk AND status IN {ACTIVE_SQL}"""
)
# A slot row held for a task that is not running under the slot's token.
ORPHAN_SLOT = """s.task_id IS NOT NULL AND NOT EXISTS (
    SELECT 1 FROM tasks t WHERE t.id = s.task_id AND t.status = 'running' AND t.attempt_token = s.token)"""
FREE_SLOT_SQL = text("UPDATE task_slots SET task_id = NULL, token = NULL WHERE task_id = :id")
# A refused message was acknowledged and dropped, so none is in flight for the task any more:
# clear its publication stamp, and the relay (when a slot frees) or the publisher re-sends it.
UNPUBLISH_SQL = text("UPDATE tasks SET last_published_at = NULL WHERE id = :id AND status = 'pending'")
# waiting_reason counts at most this many older pending tasks of the same owner.
WAITING_COUNT_CAP = 1000


def waiting_facts_sql(ownerless: bool) -> str:
    """What waiting_reason reads. The older tasks are counted in index order, newest first, so the
    scan stops at the cap: unordered, PostgreSQL built a bitmap of the owner's whole pending queue
    first (2x slower at 100 k pending than at 1 k). The cap is a constant of the statement: as a
    parameter, PostgreSQL re-planned it on every call at 100 k pending in `dtask bench scale`
    (0.61 vs 0.36 ms)."""
    same_owner = "owner IS NULL" if ownerless else "owner = :owner"
    return f"""SELECT CAST(:nb AS timestamptz) > {NOW} AS backoff,
        (SELECT count(*) FROM tasks WHERE status = 'running') AS running,
        (SELECT count(*) FROM tasks WHERE status = 'running' AND {same_owner}) AS mine_running,
        (SELECT count(*) FROM (SELECT 1 FROM tasks WHERE status = 'pending' AND {same_owner}
           AND (created_at, id) < (CAST(:created AS timestamptz), CAST(:id AS uuid))
           ORDER BY created_at DESC, id DESC
           LIMIT {WAITING_COUNT_CAP + 1}) older) AS ahead"""

Row = Mapping[str, Any]
Rows = list[Row]  # spelled once here: inside TaskRepository, `list` is the listing method


def _plain_row(record: Mapping[str, Any]) -> dict[str, Any]:
    """A driver record as SQLAlchemy would give it: asyncpg's own UUID type becomes uuid.UUID."""
    return {k: _plain_uuid(v) if isinstance(v, uuid.UUID) else v for k, v in record.items()}


def _finished(row: Row) -> Finished:
    ids, types = row.get("relay_ids") or [], row.get("relay_types") or []
    return Finished(Status(row["status"]), [(_plain_uuid(i), t) for i, t in zip(ids, types, strict=True)])


def _plain_uuid(value: uuid.UUID) -> uuid.UUID:
    return value if type(value) is uuid.UUID else uuid.UUID(int=value.int)


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


def encode_cursor(created_at: datetime, task_id: uuid.UUID) -> str:
    raw = f"{created_at.isoformat()}|{task_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, uuid.UUID]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        stamp, _, ident = raw.partition("|")
        created = datetime.fromisoformat(stamp)
        if created.tzinfo is None:
            raise ValueError("naive timestamp")
        # In UTC, or it is no instant PostgreSQL can hold (year 1 at +23:59 overflows).
        return created.astimezone(UTC), uuid.UUID(ident)
    except (ValueError, OverflowError, UnicodeDecodeError, binascii.Error) as exc:
        raise ValueError("malformed cursor") from exc


def _runnable_arrays(registry: RunnableSource) -> dict[str, list[Any]]:
    specs = registry.specs()  # type: ignore[attr-defined]
    return {"types": [s.task_type for s in specs], "versions": [s.version for s in specs]}


def _type_caps(registry: RunnableSource) -> dict[str, list[Any]]:
    capped = [s for s in registry.specs() if s.concurrency is not None]  # type: ignore[attr-defined]
    return {"ctypes": [s.task_type for s in capped], "ccaps": [s.concurrency for s in capped]}


class TaskRepository:
    def __init__(self, engine: AsyncEngine, *, now: datetime | None = None) -> None:
        self.engine = engine
        self._auto = engine.execution_options(isolation_level="AUTOCOMMIT")
        self.now = now
        self._slots = 0  # capacity slots known to exist

    def _p(self, **params: Any) -> dict[str, Any]:
        return {"now": self.now, **params}

    # ---------------------------------------------------------------- submit

    async def insert(self, conn: AsyncConnection, new: NewTask) -> Inserted:
        """Insert a pending task in the caller's transaction (domain rows may share it).

        It has no message yet (``last_published_at`` NULL): after commit the submitter publishes
        what capacity can take, stamping each row before its id is sent (claim_for_publish), so a
        refused claim's "message dropped" mark can never be overwritten by a late stamp.
        """
        for _ in range(5):
            task_id = uuid.uuid4()
            inserted = (
                (
                    await conn.execute(
                        INSERT_SQL,
                        self._p(
                            id=task_id,
                            tt=new.task_type,
                            hv=new.handler_version,
                            payload=json.dumps(new.payload),
                            owner=new.owner,
                            dk=new.dedupe_key,
                            timeout=new.timeout_seconds,
                        ),
                    )
                )
                .mappings()
                .first()
            )
            if inserted is not None:
                return Inserted(id=task_id, row=dict(inserted))
            holder = (
                await conn.execute(
                    DEDUPE_HOLDER_SQL,
                    {"owner": new.owner, "tt": new.task_type, "dk": new.dedupe_key},
                )
            ).scalar()
            if holder is not None:
                return Inserted(id=holder, duplicate_of=holder)
            # The holder finished between our insert and our look-up: the key is free again.
        raise RuntimeError("dedupe key kept changing hands; giving up")

    async def insert_many(self, conn: AsyncConnection, news: Sequence[NewTask]) -> list[Inserted]:
        """Insert many pending tasks in one statement (in order), in the caller's transaction; an
        entry whose dedupe key an active task of its owner holds (one earlier in the same batch
        included) gets that holder instead of a row."""
        if not news:
            return []
        ids = [uuid.uuid4() for _ in news]
        columns = {
            "ids": ids,
            "types": [n.task_type for n in news],
            "versions": [n.handler_version for n in news],
            "payloads": [json.dumps(n.payload) for n in news],
            "owners": [n.owner for n in news],
            "keys": [n.dedupe_key for n in news],
            "timeouts": [n.timeout_seconds for n in news],
        }
        stored = {
            row["id"]: dict(row)
            for row in (
                await conn.execute(
                    INSERT_MANY_SQL,
                    self._p(**columns),
                )
            ).mappings()
        }
        out: list[Inserted] = []
        for task_id, new in zip(ids, news, strict=True):
            if task_id in stored:
                out.append(Inserted(id=task_id, row=stored[task_id]))
            else:  # a held dedupe key: the holder (rare enough to look up one by one)
                out.append(await self.insert(conn, new))
        return out

    async def take_idempotency_key(
        self, conn: AsyncConnection, owner: str, key: str, request_hash: str
    ) -> Row | None:
        """Take ``key`` for this request in the caller's transaction: None when it is new (or its
        earlier use expired), else the earlier request's record.

        A concurrent request with the same key waits here (unique index) until the first commits,
        then reads its answer: two racing retries still create one set of tasks.
        """
        params = self._p(owner=owner, key=key, hash=request_hash, ttl=IDEMPOTENCY_TTL_SECONDS)
        take = text(
            f"""INSERT INTO idempotency_keys (owner, key, request_hash, task_ids, created_at)
            VALUES (:owner, :key, :hash, '[]'::jsonb, {NOW})
            ON CONFLICT (owner, key) DO NOTHING RETURNING key"""
        )
        if (await conn.execute(take, params)).first() is not None:
            return None
        earlier = (
            (
                await conn.execute(
                    text(
                        f"""SELECT request_hash, response, created_at < {NOW} - make_interval(secs => :ttl)
                          AS expired
                    FROM idempotency_keys WHERE owner = :owner AND key = :key FOR UPDATE"""
                    ),
                    params,
                )
            )
            .mappings()
            .first()
        )
        if earlier is None or earlier["expired"]:
            forget = "DELETE FROM idempotency_keys WHERE owner = :owner AND key = :key"
            await conn.execute(text(forget), params)
            await conn.execute(take, params)
            return None
        return dict(earlier)

    async def record_idempotent_answer(
        self, conn: AsyncConnection, owner: str, key: str, response: list[dict[str, Any]]
    ) -> None:
        ids = [entry["task_id"] for entry in response if entry.get("task_id")]
        await conn.execute(
            text(
                """UPDATE idempotency_keys SET task_ids = CAST(:ids AS jsonb), response = CAST(:resp AS jsonb)
                WHERE owner = :owner AND key = :key"""
            ),
            {"ids": json.dumps(ids), "resp": json.dumps(response), "owner": owner, "key": key},
        )

    async def prune_idempotency_keys(self, batch: int = 1000) -> int:
        """Forget Idempotency-Keys older than their time to live (bounded batch)."""
        async with self.engine.begin() as conn:
            return (
                await conn.execute(
                    text(
                        f"""DELETE FROM idempotency_keys WHERE (owner, key) IN (
                            SELECT owner, key FROM idempotency_keys
                            WHERE created_at < {NOW} - make_interval(secs => :ttl)
                            LIMIT :batch FOR UPDATE SKIP LOCKED)"""
                    ),
                    self._p(ttl=IDEMPOTENCY_TTL_SECONDS, batch=batch),
                )
            ).rowcount

    async def owner_pending(self, conn: AsyncConnection, owner: str, limit: int) -> int:
        """The owner's pending tasks (counted up to ``limit``), holding the owner's quota lock until
        the caller's transaction ends, so concurrent submissions of one owner cannot overshoot."""
        await conn.execute(
            text("SELECT pg_advisory_xact_lock(hashtextextended('dtask-owner-quota:' || :owner, 0))"),
            {"owner": owner},
        )
        return int(
            (
                await conn.execute(
                    text(
                        """SELECT count(*) FROM (SELECT 1 FROM tasks WHERE status = 'pending'
                        AND owner = :owner LIMIT :limit) mine"""
                    ),
                    {"owner": owner, "limit": limit},
                )
            ).scalar_one()
        )

    async def mark_publish_failed(self, ids: Sequence[uuid.UUID], error: str) -> None:
        if ids:
            async with self.engine.begin() as conn:
                await conn.execute(
                    text(
                        """UPDATE tasks SET publish_error = :err, last_published_at = NULL
                        WHERE id = ANY(:ids) AND status = 'pending'"""
                    ),
                    {"ids": list(ids), "err": error[:500]},
                )

    # ---------------------------------------------------------------- claim

    async def claim(
        self,
        task_id: uuid.UUID,
        registry: RunnableSource,
        *,
        capacity: int,
        lease_seconds: float,
        worker: str | None = None,
        lock_wait_seconds: float = 2.0,
        owner_max_running: int | None = None,
    ) -> Claim | str:
        """Atomically move a pending task to running under a fresh token; else the refusal reason.

        One statement takes a free capacity slot (SKIP LOCKED: claimers never wait on each other),
        marks the task running and records the attempt. Only where a per-type cap or a per-owner
        limit applies does the claim first take that type's / owner's lock, for at most
        ``lock_wait_seconds`` (``capacity_busy`` past it: the task is re-sent later).
        """
        caps = _type_caps(registry)
        params = self._p(
            id=task_id,
            tok=uuid.uuid4(),
            lease=lease_seconds,
            worker=worker,
            cap=capacity,
            omax=owner_max_running,
            **_runnable_arrays(registry),
            **caps,
        )
        for repaired in (False, True):
            await self._ensure_slots(capacity)
            try:
                claimed = None
                if not caps["ctypes"]:
                    # One statement, no lock: always without limits, and with a per-owner limit for a
                    # task that has no owner (omax 0 claims only those; the rest take the owner's lock).
                    fast = params if owner_max_running is None else {**params, "omax": 0}
                    claimed = next(iter(await self._fetch(CLAIM_SQL, fast)), None)
                if claimed is None and (caps["ctypes"] or owner_max_running is not None):
                    claimed = await self._claim_under_locks(task_id, params, lock_wait_seconds)
            except DBAPIError as exc:
                if getattr(exc.orig, "sqlstate", None) != LOCK_NOT_AVAILABLE:
                    raise
                await self.message_dropped(task_id)
                return "capacity_busy"
            if claimed is not None:
                task = dict(claimed)
                return Claim(task=task, token=task["attempt_token"], attempt=task["attempt_count"])
            reason = await self._refusal(task_id, registry, capacity, owner_max_running)
            if reason not in ("slots_missing", "slots_stale"):
                return reason
            if not repaired:
                # Slot rows were removed, or left held, behind the runtime's back (a truncated or
                # hand-edited table): repair them once and claim again.
                self._slots = 0
                await self.free_orphan_slots()
        return "capacity_full"

    async def _claim_under_locks(
        self, task_id: uuid.UUID, params: dict[str, Any], lock_wait_seconds: float
    ) -> Row | None:
        # Per-type and per-owner counts must be read after the lock that serialises their claimers
        # (a statement's snapshot is taken when it starts), so this path is a short transaction.
        async with self.engine.begin() as conn:
            row = (
                await conn.execute(text("SELECT task_type, owner FROM tasks WHERE id = :id"), {"id": task_id})
            ).first()
            if row is None:
                return None
            await conn.execute(
                text("SELECT set_config('lock_timeout', :ms, true)"),
                {"ms": f"{max(1, int(lock_wait_seconds * 1000))}ms"},
            )
            if row[0] in params["ctypes"]:
                await conn.execute(
                    text("SELECT pg_advisory_xact_lock(hashtextextended(:k, 0))"),
                    {"k": f"dtask-type:{row[0]}"},
                )
            if params["omax"] is not None and row[1] is not None:
                await conn.execute(
                    text("SELECT pg_advisory_xact_lock(hashtextextended(:k, 0))"),
                    {"k": f"dtask-owner:{row[1]}"},
                )
            claimed = (await conn.execute(CLAIM_SQL.clause, params)).mappings().first()
            return None if claimed is None else dict(claimed)

    async def end_stalled_sessions(self, older_than_seconds: float) -> int:
        """End worker sessions whose transaction has been open longer than ``older_than_seconds``.

        No transaction of a worker outlives a lease legitimately (an owning transaction that long
        rolls back at commit anyway). A worker stopped mid-transaction would hold its task's row
        lock, and the reconciler (SKIP LOCKED) would never converge that task. PostgreSQL ends an
        idle-in-transaction session after a lease by itself, but not one stopped between a
        statement's Parse and its Sync (asyncpg prepares statements that way), and
        transaction_timeout only exists from PostgreSQL 17: so the reconciler ends them here.
        """
        async with self._autocommit() as conn:
            ended = (
                await conn.execute(
                    text(
                        f"""SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                        WHERE datname = current_database() AND pid <> pg_backend_pid()
                          AND application_name LIKE 'dtask-worker:%'
                          AND xact_start < {NOW} - make_interval(secs => :age)"""
                    ),
                    self._p(age=older_than_seconds),
                )
            ).scalars().all()
        if ended:
            log.warning("ended %d worker session(s) stuck in a transaction", len(ended))
        return sum(1 for e in ended if e)

    async def free_orphan_slots(self) -> int:
        """Free capacity slots held for a task that no longer runs under that token (only a change
        made outside the runtime can leave one: every write that ends an attempt frees its slot)."""
        async with self._autocommit() as conn:
            return int(
                (
                    await conn.execute(
                        text(f"UPDATE task_slots s SET task_id = NULL, token = NULL WHERE {ORPHAN_SLOT}")
                    )
                ).rowcount
            )

    async def _ensure_slots(self, capacity: int) -> None:
        if capacity > self._slots:
            async with self._autocommit() as conn:
                await conn.execute(
                    text(
                        """INSERT INTO task_slots (slot) SELECT generate_series(0, :cap - 1)
                        ON CONFLICT (slot) DO NOTHING"""
                    ),
                    {"cap": capacity},
                )
            self._slots = capacity

    def _autocommit(self) -> Any:
        """A pooled connection without BEGIN/COMMIT round trips, for single-statement writes."""
        return self._auto.connect()

    async def _fetch(self, statement: Statement, params: Mapping[str, Any]) -> Rows:
        """Run a hot-path statement on its own through the driver; rows as dicts. The driver runs
        it in autocommit (nothing opened a transaction on the connection). The connection comes
        straight from the pool, without an engine Connection around it: its construction, the
        AUTOCOMMIT option's set and reset and its close cost about 45 us of CPU per call."""
        raw = await self.engine.raw_connection()
        try:
            driver = raw.driver_connection
            assert driver is not None  # a checked-out connection always has its driver's
            try:
                records = await driver.fetch(statement.query, *statement.args(params))
            except Exception as exc:
                if is_transient(exc):
                    # SQLAlchemy did not see the failure: drop the connection, never pool it again.
                    await greenlet_spawn(raw.invalidate)
                raise
        finally:
            # Back to the pool (closing it, if it was an overflow one, awaits the driver: greenlet).
            await greenlet_spawn(raw.close)
        return [_plain_row(r) for r in records]

    async def message_dropped(self, task_id: uuid.UUID) -> None:
        """A message for this task was acknowledged without a claim: mark it for re-sending."""
        async with self._autocommit() as conn:
            await conn.execute(UNPUBLISH_SQL, {"id": task_id})

    async def _refusal(
        self, task_id: uuid.UUID, registry: RunnableSource, capacity: int, owner_max_running: int | None
    ) -> str:
        """Why a claim took nothing; a pending task without cancel intent is marked for re-sending
        (its message was dropped), in the same statement."""
        async with self._autocommit() as conn:
            row = (
                (
                    await conn.execute(
                        text(
                            f"""WITH marked AS (
                            {UNPUBLISH_SQL.text} AND cancel_requested_at IS NULL RETURNING id)
                        SELECT status, cancel_requested_at IS NOT NULL AS cancel, task_type, handler_version,
                               not_before > {NOW} AS backoff, NOT {OWNER_UNDER_LIMIT} AS owner_full,
                               NOT EXISTS (SELECT 1 FROM task_slots WHERE slot < :cap AND task_id IS NULL)
                                 AS full,
                               (SELECT count(*) FROM task_slots WHERE slot < :cap) < :cap AS missing,
                               EXISTS (SELECT 1 FROM task_slots s WHERE s.slot < :cap AND {ORPHAN_SLOT})
                                 AS stale
                        FROM tasks WHERE id = :id"""
                        ),
                        self._p(id=task_id, omax=owner_max_running, cap=capacity),
                    )
                )
                .mappings()
                .first()
            )
        if row is None:
            return "unknown_task"
        if row["status"] != Status.PENDING:
            return f"not_pending:{row['status']}"
        if registry.runnable(row["task_type"], row["handler_version"]) is None:
            return "not_runnable"
        if row["cancel"]:
            return "cancel_requested"
        if row["backoff"]:
            return "backoff"
        if row["owner_full"]:
            return "owner_limit"
        if row["full"] and row["missing"] and self._slots:
            return "slots_missing"
        if row["full"] and row["stale"]:
            return "slots_stale"
        return "capacity_full"  # the cluster's, or the type's (TaskSpec.concurrency)

    # ---------------------------------------------------------------- owner writes

    async def heartbeat(self, task_id: uuid.UUID, token: uuid.UUID, lease_seconds: float) -> Heartbeat:
        async with self._autocommit() as conn:
            row = (
                await conn.execute(
                    text(
                        f"""UPDATE tasks SET lease_expires_at = {NOW} + make_interval(secs => :lease),
                               heartbeat_at = {NOW}
                        WHERE id = :id AND {OWNED} RETURNING cancel_requested_at IS NOT NULL"""
                    ),
                    self._p(id=task_id, tok=token, lease=lease_seconds),
                )
            ).first()
        return Heartbeat(owned=False) if row is None else Heartbeat(owned=True, cancel_requested=row[0])

    async def report(
        self, task_id: uuid.UUID, token: uuid.UUID, progress: float | None, message: str | None
    ) -> bool:
        async with self._autocommit() as conn:
            result = await conn.execute(
                text(
                    f"""UPDATE tasks SET progress = coalesce(CAST(:progress AS float8), progress),
                           message = coalesce(CAST(:message AS text), message)
                    WHERE id = :id AND {OWNED}"""
                ),
                self._p(id=task_id, tok=token, progress=progress, message=message),
            )
        return bool(result.rowcount)

    @asynccontextmanager
    async def owning_transaction(
        self, task_id: uuid.UUID, token: uuid.UUID
    ) -> AsyncIterator[tuple[AsyncConnection, Row]]:
        """Lock the task row as its live owner, let the caller write, re-check the lease, commit.

        A lapse while the caller ran or waited for a lock raises OwnershipLost and rolls back
        everything written in the block.
        """
        async with self.engine.connect() as conn, conn.begin():
            row = (
                (
                    await conn.execute(
                        text(f"SELECT * FROM tasks WHERE id = :id AND {OWNED} FOR UPDATE"),
                        self._p(id=task_id, tok=token),
                    )
                )
                .mappings()
                .first()
            )
            if row is None:
                raise OwnershipLost(str(task_id))
            yield conn, dict(row)
            # The row lock kept everyone else off the lease, so the value we locked still holds;
            # the block itself may have ended the lease (a terminal write clears it).
            await self._recheck_lease(conn, task_id, row["lease_expires_at"])

    async def finish(
        self,
        task_id: uuid.UUID,
        token: uuid.UUID,
        hooks: HookSource | None,
        *,
        status: Status,
        result: Any = None,
        error: dict[str, str] | None = None,
        detail: str | None = None,
        kind: tuple[str, int] | None = None,
    ) -> Status:
        """The owner's terminal write (see finish_and_relay), without the relay."""
        finished = await self.finish_and_relay(
            task_id, token, hooks, status=status, result=result, error=error, detail=detail, kind=kind
        )
        return finished.status

    async def finish_and_relay(
        self,
        task_id: uuid.UUID,
        token: uuid.UUID,
        hooks: HookSource | None,
        *,
        status: Status,
        result: Any = None,
        error: dict[str, str] | None = None,
        detail: str | None = None,
        kind: tuple[str, int] | None = None,
        relay: RelayOptions | None = None,
    ) -> Finished:
        """The owner's terminal write: status, attempt record, capacity slot and dedupe key given
        back, in one fenced statement; then the type's hook, in the same transaction. With
        ``relay``, the same statement stamps what the freed slot can take next (the relay's work)
        and returns it, to be published once this commit is done.

        Cancel intent beats a concurrent success. Raises OwnershipLost (nothing written) if the
        attempt no longer owns the task; a hook's exception rolls everything back and is raised as
        HookFailed (a transient database error inside the hook as itself, to be retried). Once the
        statement has ended the lease the row stays locked until commit, so no other attempt can
        own the task while the hook runs.
        """
        outcome = error["code"] if error else status.value
        params = self._p(
            id=task_id,
            tok=token,
            status=status.value,
            outcome=outcome,
            detail=detail,
            result=None if result is None else json.dumps(result),
            error=None if error is None else json.dumps(error),
            cancelled=json.dumps({"code": "cancelled", "message": "cancel requested"}),
            **self._due_params(relay),
        )
        success_hook = failure_hook = None
        if hooks is not None:
            # (type, version): given by the owner, who knows it; a row's type never changes.
            task_type = kind or await self._task_type(task_id)
            if task_type is not None:
                success_hook = hooks.hook_for(task_type[0], task_type[1], "success")
                failure_hook = hooks.hook_for(task_type[0], task_type[1], "failure")
        if success_hook is None and failure_hook is None:  # no hook to run: one round trip
            ended = next(iter(await self._fetch(FINISH_SQL, params)), None)
            if ended is None:
                raise OwnershipLost(str(task_id))
            return _finished(ended)
        async with self.engine.begin() as conn:
            row = (await conn.execute(FINISH_SQL.clause, params)).mappings().first()
            if row is None:
                raise OwnershipLost(str(task_id))
            # The final status decides the hook (cancel intent turns a success into `cancelled`);
            # the hook sees the row as the ending attempt left it, with that attempt's token.
            final = Status(row["status"])
            task = {**row, "attempt_token": token}
            for relay_column in ("relay_ids", "relay_types"):
                task.pop(relay_column, None)
            final_hook = success_hook if final == Status.SUCCESS else failure_hook
            if final_hook is not None:
                try:
                    await final_hook(conn, task, final.value)
                except Exception as exc:
                    if is_transient(exc):
                        raise
                    which = "success" if final == Status.SUCCESS else "failure"
                    raise HookFailed(
                        f"the {which} hook of {task['task_type']} raised {type(exc).__name__}"
                    ) from exc
                # The hook wrote as the owner: commit only if the lease it ended still held.
                await self._recheck_lease(conn, task_id, row["lease_was"])
        return _finished(dict(row))

    def _due_params(self, relay: RelayOptions | None) -> dict[str, Any]:
        """take_due's parameters for a terminal write's relay (limit 0: no relay)."""
        if relay is None:
            return {"cap": None, "ahead": 0, "window": 0.0, "limit": 0, "omax": None,
                    "types": [], "versions": []}
        return {"cap": relay.capacity, "ahead": relay.ahead, "window": relay.window,
                "limit": relay.limit, "omax": relay.owner_max_running,
                **_runnable_arrays(relay.registry)}

    async def _recheck_lease(self, conn: AsyncConnection, task_id: uuid.UUID, lease: datetime) -> None:
        still = (
            await conn.execute(text(f"SELECT CAST(:lease AS timestamptz) > {NOW}"), self._p(lease=lease))
        ).scalar()
        if not still:
            raise OwnershipLost(f"{task_id}: lease lapsed before commit")

    async def _task_type(self, task_id: uuid.UUID) -> tuple[str, int] | None:
        """(type, version): a row's type never changes, so this may be read before the write."""
        async with self._auto.connect() as conn:
            row = (
                await conn.execute(
                    text("SELECT task_type, handler_version FROM tasks WHERE id = :id"), {"id": task_id}
                )
            ).first()
        return None if row is None else (row[0], row[1])

    async def attempt_outcome(self, token: uuid.UUID) -> str | None:
        """The task status an ended attempt wrote (None while it has not ended, or never committed).

        After a blink that ate a COMMIT's answer, a retried terminal write is refused: this tells
        whether the first one in fact committed."""
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    text(
                        """SELECT t.status FROM task_attempts a JOIN tasks t ON t.id = a.task_id
                        WHERE a.token = :tok AND a.ended_at IS NOT NULL AND t.attempt_token IS NULL
                          AND t.attempt_count = a.attempt AND a.outcome <> 'lease_expired'"""
                    ),
                    {"tok": token},
                )
            ).first()
        return None if row is None else str(row[0])

    async def release(
        self,
        task_id: uuid.UUID,
        token: uuid.UUID,
        *,
        outcome: str,
        delay: float,
        detail: str | None = None,
        message: str | None = None,
    ) -> bool:
        """Hand a retry-safe task back to pending (worker shutdown, a transient failure), to be
        claimed again after ``delay`` seconds; False if no longer owned. ``detail`` goes to the
        attempt record, ``message`` (why it waits) to the task."""
        try:
            async with self.owning_transaction(task_id, token) as (conn, row):
                await self._to_pending(
                    conn, row, outcome=outcome, delay=delay, detail=detail, message=message
                )
        except OwnershipLost:
            return False
        return True

    # ---------------------------------------------------------------- convergence helpers

    async def _terminal(
        self,
        conn: AsyncConnection,
        row: Row,
        status: Status,
        *,
        result: Any = None,
        error: dict[str, str] | None = None,
        outcome: str,
        detail: str | None = None,
    ) -> None:
        await self._end_attempt(conn, row, outcome, detail)
        await conn.execute(FREE_SLOT_SQL, {"id": row["id"]})
        await conn.execute(
            text(
                f"""UPDATE tasks SET status = :status, finished_at = {NOW}, attempt_token = NULL,
                       lease_expires_at = NULL, result = CAST(:result AS jsonb),
                       error = CAST(:error AS jsonb),
                       progress = CASE WHEN :status = 'success' THEN 100 ELSE progress END
                WHERE id = :id"""
            ),
            self._p(
                id=row["id"],
                status=status.value,
                result=None if result is None else json.dumps(result),
                error=None if error is None else json.dumps(error),
            ),
        )

    async def _end_attempt(
        self, conn: AsyncConnection, row: Row, outcome: str, detail: str | None = None
    ) -> None:
        # A dead owner's attempt ended when its lease lapsed, not when we noticed.
        await conn.execute(
            text(
                f"""UPDATE task_attempts SET ended_at = least({NOW}, :lease), outcome = :outcome,
                       detail = :detail
                WHERE token = :tok AND ended_at IS NULL"""
            ),
            self._p(tok=row["attempt_token"], lease=row["lease_expires_at"], outcome=outcome, detail=detail),
        )

    async def _to_pending(
        self,
        conn: AsyncConnection,
        row: Row,
        *,
        outcome: str,
        delay: float,
        detail: str | None = None,
        message: str | None = None,
    ) -> None:
        await self._end_attempt(conn, row, outcome, detail)
        await conn.execute(FREE_SLOT_SQL, {"id": row["id"]})
        await conn.execute(
            text(
                f"""UPDATE tasks SET status = 'pending', attempt_token = NULL, lease_expires_at = NULL,
                       not_before = {NOW} + make_interval(secs => :delay), last_published_at = NULL,
                       message = coalesce(CAST(:message AS text), message)
                WHERE id = :id"""
            ),
            self._p(id=row["id"], delay=delay, message=message),
        )

    async def _run_hook(self, conn: AsyncConnection, hooks: HookSource, row: Row, status: Status) -> None:
        kind = "success" if status == Status.SUCCESS else "failure"
        hook = hooks.hook_for(row["task_type"], row["handler_version"], kind)
        if hook is not None:
            await hook(conn, row, status.value)

    async def _converge(
        self, conn: AsyncConnection, row: Row, status: Status, error: dict[str, str], hooks: HookSource | None
    ) -> bool:
        """Terminal transition by someone other than the owner; False if the hook failed.

        A failing hook is rolled back to a savepoint and the task still ends, without it, so one
        broken hook cannot keep a task (or the batch behind it) from converging.
        """
        await self._terminal(conn, row, status, error=error, outcome=error["code"])
        if hooks is None:
            return True
        try:
            async with conn.begin_nested():
                await self._run_hook(conn, hooks, row, status)
        except Exception as exc:  # a domain hook may raise anything
            log.exception("failure hook of task %s (%s) raised", row["id"], row["task_type"])
            await conn.execute(
                text("UPDATE tasks SET error = CAST(:error AS jsonb) WHERE id = :id"),
                {
                    "id": row["id"],
                    "error": json.dumps(
                        {**error, "message": f"{error['message']}; failure hook raised: {exc!r}"[:1000]}
                    ),
                },
            )
            return False
        return True

    # ---------------------------------------------------------------- cancel, delete, prune

    async def request_cancel(self, task_id: uuid.UUID, hooks: HookSource | None) -> str | None:
        """Cancel a task: 'cancelled' (pending, at once, with its failure hook), 'requested'
        (running: the owner stops at its next heartbeat or control point), 'terminal', or None."""
        async with self.engine.begin() as conn:
            row = (
                (await conn.execute(text("SELECT * FROM tasks WHERE id = :id FOR UPDATE"), {"id": task_id}))
                .mappings()
                .first()
            )
            if row is None:
                return None
            if row["status"] == Status.PENDING:
                await self._converge(
                    conn,
                    dict(row),
                    Status.CANCELLED,
                    {"code": "cancelled", "message": "cancelled before start"},
                    hooks,
                )
                await conn.execute(
                    text(f"UPDATE tasks SET cancel_requested_at = {NOW} WHERE id = :id"), self._p(id=task_id)
                )
                return "cancelled"
            if row["status"] == Status.RUNNING:
                await conn.execute(
                    text(
                        f"""UPDATE tasks SET cancel_requested_at = coalesce(cancel_requested_at, {NOW})
                        WHERE id = :id"""
                    ),
                    self._p(id=task_id),
                )
                return "requested"
            return "terminal"

    async def delete(self, task_id: uuid.UUID) -> str | None:
        """Delete a terminal task: 'deleted', 'active' (refused), or None for an unknown id."""
        async with self.engine.begin() as conn:
            status = (
                await conn.execute(
                    text("SELECT status FROM tasks WHERE id = :id FOR UPDATE"), {"id": task_id}
                )
            ).scalar()
            if status is None:
                return None
            if status not in (Status.SUCCESS, Status.FAILED, Status.CANCELLED):
                return "active"
            await conn.execute(text("DELETE FROM tasks WHERE id = :id"), {"id": task_id})
            return "deleted"

    async def prune(self, older_than_seconds: float, batch: int = 5000) -> int:
        """Delete terminal tasks finished longer ago than the given age, in bounded batches."""
        total = 0
        while True:
            async with self.engine.begin() as conn:
                n = (
                    await conn.execute(
                        text(
                            f"""DELETE FROM tasks WHERE id IN (
                                SELECT id FROM tasks WHERE status IN {TERMINAL_SQL}
                                  AND finished_at < {NOW} - make_interval(secs => :age)
                                LIMIT :batch FOR UPDATE SKIP LOCKED)"""
                        ),
                        self._p(age=older_than_seconds, batch=batch),
                    )
                ).rowcount
            total += n
            if n < batch:
                return total

    # ---------------------------------------------------------------- maintenance duties

    async def reconcile(
        self,
        registry: RunnableSource,
        *,
        batch: int,
        retry_delay: Any,
        stalled_after: float | None = None,
    ) -> ReconcileReport:
        """Converge expired leases, legacy (v0) rows, expired rows nobody can run, and pending rows
        that carry cancel intent (claim and publisher skip those, so only this finishes them).

        One transaction per task; rows locked elsewhere are skipped (SKIP LOCKED) so two
        reconcilers never fight; a task whose convergence fails is skipped for the rest of the run.
        """
        report = ReconcileReport()
        if stalled_after is not None:
            report.sessions_ended = await self.end_stalled_sessions(stalled_after)
        report.slots_freed = await self.free_orphan_slots()
        skip: list[uuid.UUID] = []
        for _ in range(batch):
            async with self.engine.begin() as conn:
                row = (
                    (
                        await conn.execute(
                            text(
                                f"""SELECT * FROM tasks
                            WHERE NOT (id = ANY(:skip)) AND (
                                (status = 'running' AND lease_expires_at <= {NOW})
                                OR (status IN {ACTIVE_SQL} AND handler_version = {LEGACY_VERSION})
                                OR (status = 'pending' AND cancel_requested_at IS NOT NULL))
                            ORDER BY lease_expires_at NULLS FIRST LIMIT 1 FOR UPDATE SKIP LOCKED"""
                            ),
                            self._p(skip=skip),
                        )
                    )
                    .mappings()
                    .first()
                )
                if row is None:
                    break
                try:
                    async with conn.begin_nested():
                        await self._reconcile_one(conn, dict(row), registry, report, retry_delay)
                except Exception as exc:  # one bad task never blocks the rest
                    log.exception("reconciling task %s failed", row["id"])
                    report.errors.append(f"{row['id']}: {exc!r}")
                    skip.append(row["id"])
        return report

    async def _reconcile_one(
        self,
        conn: AsyncConnection,
        row: Row,
        registry: RunnableSource,
        report: ReconcileReport,
        retry_delay: Any,
    ) -> None:
        version = row["handler_version"]
        cancel = row["cancel_requested_at"] is not None
        if version == LEGACY_VERSION:
            ok = await self._converge_legacy(conn, row, registry)
            report.legacy += 1
        elif row["status"] == Status.PENDING:
            # Pending with cancel intent (e.g. a retry-safe task handed back at worker shutdown just
            # after cancel was requested): claims refuse it and the publisher skips it, so without
            # this it would stay pending forever (I3). The hook source only serves runnable versions.
            ok = await self._converge(
                conn,
                row,
                Status.CANCELLED,
                {"code": "cancelled", "message": "cancel requested while pending"},
                registry,
            )
            report.cancelled += 1
        else:
            spec = registry.runnable(row["task_type"], version)
            if spec is None:
                ok = await self._converge(
                    conn,
                    row,
                    Status.FAILED,
                    {
                        "code": "handler_unavailable",
                        "message": f"no handler for {row['task_type']} version {version}",
                    },
                    None,
                )
                report.unrunnable += 1
            elif spec.retry_safe and row["attempt_count"] < spec.max_attempts and not cancel:
                await self._to_pending(
                    conn, row, outcome="lease_expired", delay=retry_delay(row["attempt_count"])
                )
                report.retried += 1
                return
            else:
                status = Status.CANCELLED if row["cancel_requested_at"] else Status.FAILED
                ok = await self._converge(
                    conn,
                    row,
                    status,
                    {"code": "lease_expired", "message": "the owner stopped renewing its lease"},
                    registry,
                )
                report.failed += 1
        if not ok:
            report.hook_errors += 1

    async def _converge_legacy(self, conn: AsyncConnection, row: Row, registry: RunnableSource) -> bool:
        """A non-terminal task of the pre-durable release: whatever ran it died with the old process.

        Its cancel intent is honoured (``cancelled``), otherwise it ends ``failed``
        (``legacy_interrupted``), both through the current type's failure hook; a type this
        deployment no longer has fails closed, without any hook.
        """
        cancel = row["cancel_requested_at"] is not None
        if row["task_type"] not in registry:
            status = Status.CANCELLED if cancel else Status.FAILED
            message = f"no handler for {row['task_type']} (a task of the pre-durable release)"
            error = {"code": "handler_unavailable", "message": message}
            return await self._converge(conn, row, status, error, None)
        if cancel:
            status = Status.CANCELLED
            error = {"code": "cancelled", "message": "cancel requested before the upgrade"}
        else:
            status = Status.FAILED
            error = {"code": "legacy_interrupted", "message": INTERRUPTED_MESSAGE}
        return await self._converge(conn, row, status, error, registry)

    async def legacy_backlog(self) -> dict[str, int]:
        """Tasks of the pre-durable release still waiting for the reconciler, by status."""
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                text(
                    f"""SELECT status, count(*) FROM tasks
                    WHERE handler_version = {LEGACY_VERSION} AND status IN {ACTIVE_SQL} GROUP BY status"""
                )
            )
            return {status: int(n) for status, n in rows}

    async def fail_unrunnable_pending(self, registry: RunnableSource, *, batch: int) -> int:
        """Fail closed pending (non-legacy) tasks whose type or version this deployment cannot run."""
        pairs = [(s.task_type, s.version) for s in registry.specs()]  # type: ignore[attr-defined]
        n = 0
        async with self.engine.begin() as conn:
            rows = (
                (
                    await conn.execute(
                        text(
                            f"""SELECT * FROM tasks
                        WHERE status = 'pending' AND handler_version <> {LEGACY_VERSION}
                          AND (task_type, handler_version) NOT IN (
                              SELECT * FROM unnest(CAST(:types AS text[]), CAST(:versions AS int[])))
                        LIMIT :batch FOR UPDATE SKIP LOCKED"""
                        ),
                        {"types": [p[0] for p in pairs], "versions": [p[1] for p in pairs], "batch": batch},
                    )
                )
                .mappings()
                .all()
            )
            for row in rows:
                await self._converge(
                    conn,
                    dict(row),
                    Status.FAILED,
                    {
                        "code": "handler_unavailable",
                        "message": f"no handler for {row['task_type']} version {row['handler_version']}",
                    },
                    None,
                )
                n += 1
        return n

    async def claim_for_publish(self, registry: RunnableSource, **options: Any) -> list[uuid.UUID]:
        """The ids ``take_due`` (same options) stamped as published."""
        return [task_id for task_id, _type in await self.take_due(registry, **options)]

    async def take_due(
        self,
        registry: RunnableSource,
        *,
        limit: int,
        republish_after: float | None,
        capacity: int | None = None,
        ahead: int = 0,
        window: float = 60.0,
        owner_max_running: int | None = None,
        conn: AsyncConnection | None = None,
    ) -> list[tuple[uuid.UUID, str]]:
        """The oldest runnable pending tasks the cluster can take now (id, type), stamped as
        published.

        The budget is what capacity can take: ``capacity + ahead`` minus the tasks running and
        minus the messages in flight (pending tasks published within ``window``), so a thousand
        submitted tasks put about capacity + ahead messages on the broker, not a thousand; each
        slot freed later is handed on by the relay. Always due: tasks with no message in flight
        (never sent, or their message was dropped by a refused claim). With ``republish_after``
        (the publisher) also tasks sent longer ago than that, whose message may be lost. Without
        ``capacity``, no budget: up to ``limit``. In ``conn``'s transaction if given (a submission
        stamps its own tasks before its commit, then publishes them).
        """
        params = self._p(
            cap=capacity,
            ahead=ahead,
            window=window,
            limit=limit,
            omax=owner_max_running,
            **_runnable_arrays(registry),
        )
        statement = RELAY_DUE_SQL
        if republish_after is not None:
            statement, params["after"] = PUBLISH_DUE_SQL, republish_after
        if conn is None:
            rows = await self._fetch(statement, params)
        else:
            rows = [dict(r) for r in (await conn.execute(statement.clause, params)).mappings()]
        due = sorted(rows, key=lambda r: (r["created_at"], r["id"]))
        return [(r["id"], r["task_type"]) for r in due]

    # ---------------------------------------------------------------- reads

    async def get(self, task_id: uuid.UUID) -> Row | None:
        async with self.engine.connect() as conn:
            row = (
                (await conn.execute(text("SELECT * FROM tasks WHERE id = :id"), {"id": task_id}))
                .mappings()
                .first()
            )
        return None if row is None else dict(row)

    async def waiting_reason(
        self, row: Row, capacity: int, *, owner_max_running: int | None = None
    ) -> str | None:
        """Why a pending task is not running yet, in words a user can act on.

        It names only the task's own owner's queue (never the cluster's backlog, which would tell
        one tenant about the others), and counts at most WAITING_COUNT_CAP rows: the cost stays
        flat however many tasks are pending.
        """
        if row["status"] != Status.PENDING:
            return None
        if row["cancel_requested_at"] is not None:
            return "cancel requested"
        if row["publish_error"]:
            return f"publish failed: {row['publish_error']}"
        async with self.engine.connect() as conn:
            facts = (
                (
                    await conn.execute(
                        text(waiting_facts_sql(row["owner"] is None)),
                        self._p(
                            nb=row["not_before"],
                            created=row["created_at"],
                            id=row["id"],
                            owner=row["owner"],
                        ),
                    )
                )
                .mappings()
                .one()
            )
        ahead = int(facts["ahead"])
        older = (
            f"more than {WAITING_COUNT_CAP:,} older tasks of yours"
            if ahead > WAITING_COUNT_CAP
            else f"{ahead} older task{'s' if ahead != 1 else ''} of yours"
        )
        behind = f", behind {older}" if ahead else ""
        if facts["backoff"]:
            return f"retry backoff until {row['not_before'].isoformat()}"
        if owner_max_running is not None and facts["mine_running"] >= owner_max_running:
            return f"your running limit is reached ({facts['mine_running']} of {owner_max_running})"
        if facts["running"] >= capacity:
            return f"capacity full ({facts['running']} of {capacity} running){behind}"
        if row["last_published_at"] is None:
            # Capacity's worth of messages is already on the broker: this one is sent (by the
            # relay) as soon as a slot frees.
            return f"waiting for a free slot{behind}"
        if ahead:
            return f"behind {older}"
        return "waiting for a worker"

    async def summary(self, owner: str | None = None) -> dict[str, Any]:
        """Exact counts by status and by type (one owner's tasks, or all)."""
        where, params = ("WHERE owner = :owner", {"owner": owner}) if owner is not None else ("", {})
        async with self.engine.connect() as conn:
            rows = (
                await conn.execute(
                    text(f"SELECT task_type, status, count(*) FROM tasks {where} GROUP BY task_type, status"),
                    params,
                )
            ).all()
        by_status: dict[str, int] = {s.value: 0 for s in Status}
        by_type: dict[str, dict[str, int]] = {}
        for task_type, status, count in rows:
            by_status[status] += count
            by_type.setdefault(task_type, {})[status] = count
        return {"total": sum(by_status.values()), "by_status": by_status, "by_type": by_type}

    async def oldest_pending_age(self) -> float | None:
        """Seconds since the oldest pending task was created (None when nothing waits)."""
        async with self.engine.connect() as conn:
            age = (
                await conn.execute(
                    text(
                        f"""SELECT extract(epoch FROM {NOW} - min(created_at)) FROM tasks
                        WHERE status = 'pending'"""
                    ),
                    self._p(),
                )
            ).scalar()
        return None if age is None else float(age)

    async def list(
        self,
        *,
        status: str | None = None,
        task_type: str | None = None,
        owner: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> tuple[list[Row], str | None]:
        """Newest first, keyset-paged on (created_at, id): cost does not grow with the page number.

        Only the filters given become predicates (a ``CAST(:x) IS NULL OR ...`` form would keep
        the planner off the owner index).
        """
        if limit < 1:
            raise ValueError("limit must be at least 1")
        conds: list[str] = []
        params: dict[str, Any] = {"limit": limit + 1}
        if status is not None:
            conds.append("status = :status")
            params["status"] = status
        if task_type is not None:
            conds.append("task_type = :tt")
            params["tt"] = task_type
        if owner is not None:
            conds.append("owner = :owner")
            params["owner"] = owner
        if cursor:
            params["c_at"], params["c_id"] = decode_cursor(cursor)
            conds.append("(created_at, id) < (CAST(:c_at AS timestamptz), CAST(:c_id AS uuid))")
        where = f"WHERE {' AND '.join(conds)}" if conds else ""
        async with self.engine.connect() as conn:
            rows = (
                (
                    await conn.execute(
                        text(f"SELECT * FROM tasks {where} ORDER BY created_at DESC, id DESC LIMIT :limit"),
                        params,
                    )
                )
                .mappings()
                .all()
            )
        items: list[Row] = [dict(r) for r in rows[:limit]]
        nxt = encode_cursor(items[-1]["created_at"], items[-1]["id"]) if len(rows) > limit else None
        return items, nxt

    async def attempts(self, task_id: uuid.UUID) -> Rows:
        async with self.engine.connect() as conn:
            rows = (
                (
                    await conn.execute(
                        text("SELECT * FROM task_attempts WHERE task_id = :id ORDER BY attempt"),
                        {"id": task_id},
                    )
                )
                .mappings()
                .all()
            )
        return [dict(r) for r in rows]

    async def schema_revision(self) -> str | None:
        try:
            async with self.engine.connect() as conn:
                return (await conn.execute(text("SELECT version_num FROM alembic_version"))).scalar()
        except DBAPIError:
            return None
