"""Scheduler duty (scheduled by beat every DTASK_SCHEDULE_SECONDS, run by a worker on the duties
queue): turn the due slots of active schedules into pending tasks, then hand them to the relay.

One pass, one transaction: lock the due schedules (SKIP LOCKED), compute each one's slot and next
slot in Python, then one statement fires them all (ScheduleStore.fire). A slot fires at most once,
whatever runs twice: two beats, a beat restarted mid-slot, two workers taking duty messages at
once. The lock makes a second pass skip or find nothing due; the slot key refuses what gets past
it. Slots missed while nothing ran fire once, as the latest of them (a catch-up, not a burst).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tasks_core.duties.relay import relay
from tasks_core.registry import Registry
from tasks_core.schedule_rules import Rule
from tasks_core.services import Services
from tasks_core.settings import Settings
from tasks_core.store.schedules import Fire, ScheduleStore

log = logging.getLogger(__name__)


@dataclass
class ScheduleReport:
    due: int  # schedules whose slot this pass fired (or refused: their type or payload went bad)
    created: int  # tasks created
    published: int


def plan_fire(row: dict[str, Any], registry: Registry, settings: Settings) -> Fire:
    """What to do with one due schedule row (it carries the pass's ``now``). The payload passed
    every check of a submission at creation; what can have changed since is the deployment: the
    type may be gone, its payload schema may have changed. Either makes no task, and says why."""
    slot, nxt = Rule.of_row(row).plan(row["next_run_at"], row["now"])
    spec = registry.get(row["task_type"])
    if spec is None:
        return Fire(row["id"], slot, nxt, error=f"unknown task type {row['task_type']!r}")
    if spec.payload is not None:
        try:
            spec.payload.model_validate(row["payload"])
        except ValidationError as exc:
            summary = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or '(object)'}: {e['msg']}" for e in exc.errors()
            )
            return Fire(row["id"], slot, nxt, error=f"payload no longer valid: {summary}"[:500])
    timeout = min(spec.timeout_seconds or settings.default_timeout_seconds, settings.max_timeout_seconds)
    return Fire(row["id"], slot, nxt, uuid.uuid4(), spec.version, float(timeout))


async def fire_due(services: Services) -> ScheduleReport:
    store = ScheduleStore.of(services)
    async with services.engine.begin() as conn:
        due = await store.due(conn, services.settings.publish_batch)
        fires = [plan_fire(row, services.registry, services.settings) for row in due]
        created = await store.fire(conn, fires)
    for fire in fires:
        if fire.error:
            log.warning("schedule %s made no task: %s", fire.schedule_id, fire.error)
    # Committed: the relay sends what capacity can take (these tasks, or older ones); the rest wait
    # for freed slots or the publisher, like any pending task.
    published = len((await relay(services, by="scheduler")).ids) if created else 0
    return ScheduleReport(due=len(fires), created=len(created), published=published)
