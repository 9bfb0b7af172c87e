"""Publisher duty (scheduled by beat, run by a worker): publish pending intents with no message in
flight and re-publish those sent longer ago than DTASK_PUBLISH_SECONDS (their message may be lost),
oldest first, as far as capacity can take them; fail closed pending tasks whose type or version
this deployment can no longer run. Safe to run twice at once (SKIP LOCKED)."""

from __future__ import annotations

from dataclasses import dataclass

from tasks_core.duties.relay import publish_due
from tasks_core.services import Services


@dataclass
class PublishReport:
    published: int
    failed_closed: int


async def publish_pending(services: Services) -> PublishReport:
    s = services.settings
    failed = await services.repo.fail_unrunnable_pending(services.registry, batch=s.publish_batch)
    due = await services.repo.take_due(
        services.registry,
        capacity=s.capacity,
        ahead=s.ahead,
        window=s.publish_seconds,
        limit=s.publish_batch,
        republish_after=s.publish_seconds,
        owner_max_running=s.owner_running_limit,
    )
    sent = await publish_due(services, due, by="publisher")
    return PublishReport(published=len(sent.ids), failed_closed=failed)
