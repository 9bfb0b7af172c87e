"""The submission API: validate intents, commit them, and only then publish their ids.

A publish failure leaves the pending intent (the publisher re-sends it) and is reported in the
result, never raised as a lost task. Domains that create their own rows with a task use
``Submitter.transaction()`` so both commit together.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncConnection

from tasks_core.db import is_transient
from tasks_core.duties.relay import Relayed, publish_due, take_relay_due
from tasks_core.model import MAX_PRIORITY, MIN_PRIORITY
from tasks_core.registry import Registry, TaskSpec
from tasks_core.services import Services
from tasks_core.settings import Settings
from tasks_core.store.group_commit import GroupCommit
from tasks_core.store.outcomes import NewTask
from tasks_core.views import scheduled_reason

log = logging.getLogger(__name__)
MAX_BATCH = 1000


class InvalidTask(ValueError):
    """A refused intent: nothing was stored. ``status`` is the HTTP answer, ``code`` the batch
    entry's error code; ``errors`` the payload model's field errors, where there are any."""

    status = 422
    code = "invalid"

    def __init__(self, field_name: str, message: str, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message
        self.errors = errors or []


class Forbidden(InvalidTask):
    """The caller may not submit this type (diagnostics types and DTASK_DIAGNOSTICS)."""

    status = 403
    code = "forbidden"


class OverQuota(InvalidTask):
    """The owner already has DTASK_OWNER_MAX_PENDING pending tasks."""

    status = 429
    code = "quota"


@dataclass(frozen=True)
class TaskIntent:
    task_type: Any
    payload: Any = field(default_factory=dict)
    handler_version: Any = None
    dedupe_key: Any = None
    timeout_seconds: Any = None
    # Not claimable before this instant (an aware datetime or RFC 3339 text with a zone), or
    # before delay_seconds after the submission (PostgreSQL's clock); at most one of the two.
    run_at: Any = None
    delay_seconds: Any = None
    # Higher first among claimable tasks, then older (MIN_PRIORITY..MAX_PRIORITY).
    priority: Any = 0


@dataclass
class Submitted:
    task_id: uuid.UUID
    # The active task that already holds the dedupe key; nothing new was stored.
    duplicate_of: uuid.UUID | None = None
    published: bool = False
    publish_error: str | None = None
    # The answer to an earlier request with the same Idempotency-Key: nothing new was stored.
    replayed: bool = False
    # The row as stored (None for a duplicate or a replay).
    row: Mapping[str, Any] | None = None

    def waiting_reason(self) -> str:
        """Why the task just submitted waits, from what the submission knows (no query)."""
        scheduled = self.row and self.row.get("run_at")
        if scheduled:
            return scheduled_reason(scheduled)
        if self.publish_error:
            return f"publish failed: {self.publish_error}"
        return "waiting for a worker" if self.published else "waiting for a free slot"


# Deeper payloads are refused: nothing legitimate nests this far, and a recursive walk (ours,
# an encoder's, a handler's) would hit Python's recursion limit on a few hundred bytes of input.
MAX_PAYLOAD_DEPTH = 64


def _text_problem(value: str) -> str | None:
    """PostgreSQL text and jsonb hold neither U+0000 nor lone surrogates (not valid Unicode)."""
    if "\x00" in value:
        return "may not contain U+0000 (PostgreSQL cannot store it)"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "must be valid Unicode (a lone surrogate such as \\ud800 is not)"
    return None


def _payload_problem(payload: Any) -> str | None:
    """Walk the payload without recursion: depth, U+0000 and lone surrogates in keys and strings."""
    stack: list[tuple[Any, int]] = [(payload, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            problem = _text_problem(value)
            if problem:
                return f"strings {problem}"
        elif isinstance(value, dict | list):
            if depth > MAX_PAYLOAD_DEPTH:
                return f"nested deeper than {MAX_PAYLOAD_DEPTH} levels"
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    stack.append((key, depth))
                stack.append((item, depth + 1))
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# A delay past this is a mistake in units, not a plan (and PostgreSQL's intervals overflow far
# beyond it); run_at has no such bound.
MAX_DELAY_SECONDS = 10 * 366 * 86400


def _run_at(value: Any) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise InvalidTask("run_at", "must be an RFC 3339 instant, e.g. 2026-12-24T18:00:00Z") from None
    if not isinstance(value, datetime):
        raise InvalidTask("run_at", "must be an RFC 3339 instant (text) or an aware datetime")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidTask("run_at", "must name its zone (Z or +hh:mm): a local time is ambiguous")
    return value


def _schedule(intent: TaskIntent) -> tuple[datetime | None, float | None, int]:
    """run_at, delay_seconds and priority as stored, or InvalidTask."""
    if intent.run_at is not None and intent.delay_seconds is not None:
        raise InvalidTask("run_at", "give run_at or delay_seconds, not both")
    delay = intent.delay_seconds
    if delay is not None and (not _is_number(delay) or not math.isfinite(delay) or delay < 0):
        raise InvalidTask("delay_seconds", "must be a finite number of seconds, at least 0")
    if delay is not None and delay > MAX_DELAY_SECONDS:
        raise InvalidTask("delay_seconds", f"must be at most {MAX_DELAY_SECONDS} s (10 years); use run_at")
    priority = intent.priority
    integer = isinstance(priority, int) and not isinstance(priority, bool)
    if not integer or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidTask("priority", f"must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}")
    return _run_at(intent.run_at), None if delay is None else float(delay), priority


def may_submit(spec: TaskSpec, settings: Settings, admin: bool, public: bool = False) -> bool:
    """Diagnostics types follow DTASK_DIAGNOSTICS; internal types are not ``public`` (POST /tasks,
    `dtask submit`); every other type is open to every key."""
    if public and spec.internal:
        return False
    if not spec.diagnostic:
        return True
    return settings.diagnostics == "all" or (settings.diagnostics == "admin" and admin)


def _check_payload_model(spec: TaskSpec, payload: dict[str, Any]) -> None:
    if spec.payload is None:
        return
    try:
        spec.payload.model_validate(payload)
    except ValidationError as exc:
        errors = [
            {"loc": ["payload", *e["loc"]], "msg": e["msg"], "type": e["type"]}
            for e in exc.errors(include_url=False, include_input=False)
        ]
        summary = "; ".join(f"{'.'.join(map(str, e['loc'][1:])) or '(object)'}: {e['msg']}" for e in errors)
        raise InvalidTask("payload", summary, errors) from None


def validate(
    intent: TaskIntent,
    registry: Registry,
    settings: Settings,
    owner: str | None,
    *,
    admin: bool = True,
    public: bool = False,
) -> NewTask:
    """The stored form of ``intent``, or InvalidTask. ``public``: submitted through POST /tasks or
    `dtask submit` (internal types refused), not by a domain's own code."""
    s = settings
    if not isinstance(intent.task_type, str) or not intent.task_type:
        raise InvalidTask("task_type", "must be a non-empty string")
    spec = registry.get(intent.task_type)
    if spec is None:
        known = ", ".join(sorted(t.task_type for t in registry.specs() if may_submit(t, s, admin, public)))
        raise InvalidTask("task_type", f"unknown task type {intent.task_type!r}; known types: {known}")
    if public and spec.internal:
        raise Forbidden(
            "task_type",
            f"{spec.task_type} tasks are created by their domain's own routes, with the rows they work on",
        )
    if not may_submit(spec, s, admin):
        who = "nobody" if s.diagnostics == "off" else "admin keys only"
        raise Forbidden(
            "task_type", f"{spec.task_type} is a diagnostics type: {who} here (DTASK_DIAGNOSTICS)"
        )
    version = intent.handler_version
    if version is None:
        version = spec.version
    elif not isinstance(version, int) or isinstance(version, bool) or version != spec.version:
        raise InvalidTask(
            "handler_version", f"{intent.task_type} runs version {spec.version} only, not {version!r}"
        )
    if not isinstance(intent.payload, dict):
        raise InvalidTask("payload", "must be a JSON object")
    problem = _payload_problem(intent.payload)
    if problem:
        raise InvalidTask("payload", problem)
    try:
        size = len(json.dumps(intent.payload, allow_nan=False).encode())
    except (TypeError, ValueError) as exc:
        raise InvalidTask("payload", f"not JSON-serializable: {exc}") from exc
    if size > s.max_payload_bytes:
        raise InvalidTask("payload", f"{size} bytes is over the {s.max_payload_bytes}-byte limit")
    _check_payload_model(spec, intent.payload)
    timeout = intent.timeout_seconds
    if timeout is None:
        timeout = min(spec.timeout_seconds or s.default_timeout_seconds, s.max_timeout_seconds)
    elif not _is_number(timeout) or not math.isfinite(timeout) or timeout <= 0:
        raise InvalidTask("timeout_seconds", "must be a positive, finite number of seconds")
    elif timeout > s.max_timeout_seconds:
        raise InvalidTask("timeout_seconds", f"must be at most {s.max_timeout_seconds:g} s")
    key = intent.dedupe_key
    if key is not None and (
        not isinstance(key, str) or not key or len(key) > s.max_dedupe_key_length or _text_problem(key)
    ):
        raise InvalidTask(
            "dedupe_key",
            f"must be a string of 1-{s.max_dedupe_key_length} valid Unicode characters, without U+0000",
        )
    run_at, delay, priority = _schedule(intent)
    return NewTask(
        task_type=intent.task_type,
        handler_version=version,
        payload=intent.payload,
        timeout_seconds=float(timeout),
        dedupe_key=key,
        owner=owner,
        run_at=run_at,
        delay_seconds=delay,
        priority=priority,
    )


def _quota_applies(settings: Settings, owner: str | None) -> bool:
    """DTASK_OWNER_MAX_PENDING counts this owner's tasks (the Python API's ownerless ones are exempt)."""
    return settings.owner_max_pending is not None and owner is not None


class SubmitTransaction:
    """Intents added here commit with the caller's domain writes on ``conn``."""

    def __init__(
        self, submitter: Submitter, conn: AsyncConnection, owner: str | None, admin: bool, public: bool
    ) -> None:
        self.submitter = submitter
        self.conn = conn
        self.owner = owner
        self.admin = admin
        self.public = public
        self.results: list[Submitted] = []
        self._pending: int | None = None  # the owner's pending count, once this transaction read it

    async def add(self, intent: TaskIntent) -> Submitted:
        return await self.add_new(self._validate(intent))

    async def add_new(self, new: NewTask) -> Submitted:
        """Insert an intent already validated, counting it against its owner's quota when that
        owner is this transaction's (an admin's retry of another owner's task is not counted)."""
        services = self.submitter.services
        limit = services.settings.owner_max_pending
        if limit is not None and self.owner is not None and new.owner == self.owner:
            if self._pending is None:
                # Locks the owner's quota until commit: concurrent submissions cannot overshoot it.
                self._pending = await services.repo.owner_pending(self.conn, self.owner, limit)
            if self._pending >= limit:
                raise OverQuota(
                    "task_type", f"you have {limit} pending tasks, the most allowed (DTASK_OWNER_MAX_PENDING)"
                )
        inserted = await services.repo.insert(self.conn, new)
        result = Submitted(task_id=inserted.id, duplicate_of=inserted.duplicate_of, row=inserted.row)
        if inserted.duplicate_of is None and self._pending is not None:
            self._pending += 1
        self.results.append(result)
        return result

    def _validate(self, intent: TaskIntent) -> NewTask:
        services = self.submitter.services
        return validate(
            intent, services.registry, services.settings, self.owner, admin=self.admin, public=self.public
        )

    async def add_valid(self, news: Sequence[NewTask]) -> list[Submitted]:
        """Insert intents already validated, in one statement (in order); no quota check."""
        inserted = await self.submitter.services.repo.insert_many(self.conn, news)
        added = [Submitted(task_id=r.id, duplicate_of=r.duplicate_of, row=r.row) for r in inserted]
        self.results += added
        return added

    async def add_many(self, intents: Sequence[TaskIntent]) -> list[Submitted | InvalidTask]:
        """Validate each intent; insert the valid ones in one statement (in order). Each invalid one
        is reported in its place, and stores nothing."""
        services = self.submitter.services
        if _quota_applies(services.settings, self.owner):
            outcomes: list[Submitted | InvalidTask] = []
            for intent in intents:  # the quota is counted entry by entry
                try:
                    outcomes.append(await self.add(intent))
                except InvalidTask as exc:
                    outcomes.append(exc)
            return outcomes
        checked: list[NewTask | InvalidTask] = []
        for intent in intents:
            try:
                checked.append(self._validate(intent))
            except InvalidTask as exc:
                checked.append(exc)
        added = iter(await self.add_valid([c for c in checked if isinstance(c, NewTask)]))
        return [c if isinstance(c, InvalidTask) else next(added) for c in checked]


@dataclass(frozen=True)
class Idempotency:
    """An Idempotency-Key (per owner, kept IDEMPOTENCY_TTL_SECONDS) and a hash of the request it
    came with: a retried request gets the first one's answer, never a second copy of its tasks."""

    key: str
    request_hash: str


class IdempotencyKeyReused(InvalidTask):
    """The key was first used with a different request."""

    code = "idempotency_key_reused"


def _record(outcome: Submitted | InvalidTask) -> dict[str, Any]:
    if isinstance(outcome, InvalidTask):
        return {"error": {"field": outcome.field, "message": outcome.message, "code": outcome.code,
                          "status": outcome.status}}
    return {"task_id": str(outcome.task_id),
            "duplicate_of": None if outcome.duplicate_of is None else str(outcome.duplicate_of)}


def _replay(entry: dict[str, Any]) -> Submitted | InvalidTask:
    if "error" in entry:
        error = InvalidTask(entry["error"]["field"], entry["error"]["message"])
        error.code, error.status = entry["error"]["code"], entry["error"]["status"]
        return error
    duplicate = entry.get("duplicate_of")
    return Submitted(
        task_id=uuid.UUID(entry["task_id"]), duplicate_of=uuid.UUID(duplicate) if duplicate else None,
        published=True, replayed=True,
    )


class Submitter:
    def __init__(self, services: Services) -> None:
        self.services = services

    @asynccontextmanager
    async def transaction(
        self, owner: str | None = None, *, admin: bool = True, public: bool = False
    ) -> AsyncIterator[SubmitTransaction]:
        """``admin=False`` for callers acting for an ordinary API key (diagnostics policy);
        ``public=True`` for POST /tasks and `dtask submit` (internal types refused)."""
        async with self.services.engine.connect() as conn, conn.begin():
            tx = SubmitTransaction(self, conn, owner, admin, public)
            yield tx
            new = [r for r in tx.results if r.duplicate_of is None]
            # What capacity can take now (these tasks or older ones) is stamped in this same
            # transaction: no second connection or statement of its own after the commit.
            due = await take_relay_due(self.services, conn) if new else []
        # Committed: now, and only now, the ids may travel.
        await self._publish(new, due)

    async def submit(
        self,
        intent: TaskIntent,
        owner: str | None = None,
        *,
        admin: bool = True,
        idempotency: Idempotency | None = None,
        public: bool = False,
    ) -> Submitted:
        """Store one intent and publish it. Concurrent calls share a transaction (group commit),
        except with an Idempotency-Key or an owner quota, whose checks lock per request."""
        settings = self.services.settings
        grouped = settings.submit_group_max > 1 and not _quota_applies(settings, owner)
        if idempotency is None and grouped:
            new = validate(intent, self.services.registry, settings, owner, admin=admin, public=public)
            return await self._group()(new)
        [outcome] = await self._submit(
            [intent], owner, admin, idempotency, all_or_nothing=True, public=public
        )
        if isinstance(outcome, InvalidTask):  # only a replayed refusal gets here
            raise outcome
        return outcome

    async def submit_many(
        self,
        intents: Sequence[TaskIntent],
        owner: str | None = None,
        *,
        admin: bool = True,
        idempotency: Idempotency | None = None,
        public: bool = False,
    ) -> list[Submitted | InvalidTask]:
        """Validate each entry; the valid ones commit in one transaction and publish in one pass."""
        if len(intents) > MAX_BATCH:
            raise InvalidTask("tasks", f"at most {MAX_BATCH} tasks per batch")
        return await self._submit(intents, owner, admin, idempotency, all_or_nothing=False, public=public)

    async def _submit(
        self,
        intents: Sequence[TaskIntent],
        owner: str | None,
        admin: bool,
        idempotency: Idempotency | None,
        *,
        all_or_nothing: bool,
        public: bool,
    ) -> list[Submitted | InvalidTask]:
        repo = self.services.repo
        async with self.transaction(owner, admin=admin, public=public) as tx:
            outcomes: list[Submitted | InvalidTask] = []
            if idempotency is not None:
                earlier = await repo.take_idempotency_key(
                    tx.conn, owner or "", idempotency.key, idempotency.request_hash
                )
                if earlier is not None:
                    if earlier["request_hash"] != idempotency.request_hash:
                        raise IdempotencyKeyReused(
                            "Idempotency-Key", "this key was already used with a different request"
                        )
                    return [_replay(entry) for entry in earlier["response"]]
            if all_or_nothing:
                # nothing is stored on a refusal, the key included: a retry is judged afresh
                outcomes = [await tx.add(intent) for intent in intents]
            else:
                outcomes = await tx.add_many(intents)
            if idempotency is not None:
                await repo.record_idempotent_answer(
                    tx.conn, owner or "", idempotency.key, [_record(o) for o in outcomes]
                )
        return outcomes

    def _group(self) -> GroupCommit[NewTask, Submitted]:
        group = self.services.submit_group
        if group is None:
            group = GroupCommit(self._commit_group, max_size=self.services.settings.submit_group_max)
            self.services.submit_group = group
        return group

    async def _commit_group(self, news: Sequence[NewTask]) -> list[Submitted]:
        """One transaction for validated intents of any owners (each NewTask carries its own)."""
        async with self.transaction() as tx:
            added = await tx.add_valid(news)
        return added

    async def _publish(self, results: list[Submitted], due: list[tuple[uuid.UUID, str]]) -> None:
        """Publish what the transaction stamped, oldest pending first (these tasks or older ones);
        the rest wait, unsent, for the relay to hand them a freed slot."""
        if not results:
            return
        try:
            relayed = await publish_due(self.services, due, by="submit")
        except Exception as exc:  # committed intents are never reported lost: the publisher sends them
            if not is_transient(exc):
                raise
            log.warning("publishing after a submission failed: %s", type(exc).__name__)
            relayed = Relayed(error=f"{type(exc).__name__}: publishing failed; the publisher will retry")
        sent = set(relayed.ids)
        for r in results:
            r.published = r.task_id in sent
            r.publish_error = None if r.published else relayed.error
