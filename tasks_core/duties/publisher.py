"""Publisher duty (scheduled by beat, run by a worker): publish pending intents with no message in
flight and re-publish those sent longer ago than DTASK_PUBLISH_SECONDS (their message may be lost),
oldest first, as far as capacity can take them; fail closed pending tasks whose type or version
this deployment can no longer run. Safe to run twice at once (SKIP LOCKED)."""

from __future__ import annotations

from dataclasses import dataclass

from tasks_core.duties.relay import publish_due, take_relay_due
from tasks_core.services import Services


@dataclass
class PublishReport:
    published: int
    failed_closed: int


async def publish_pending(services: Services) -> PublishReport:
    s = services.settings
    failed = await services.repo.fail_unrunnable_pending(services.registry, batch=s.publish_batch)
    due = await take_relay_due(services, republish_after=s.publish_seconds)
    sent = await publish_due(services, due, by="publisher")
    return PublishReport(published=len(sent.ids), failed_closed=failed)
