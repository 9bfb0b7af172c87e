"""Relay: when a slot frees, publish about that many of the oldest pending intents at once, so
normal capacity turnover never waits for the periodic publisher."""

from __future__ import annotations

import logging
import uuid

from tasks_core import metrics
from tasks_core.services import Services

log = logging.getLogger(__name__)


async def relay(services: Services) -> int:
    free = await services.repo.free_slots(services.settings.capacity)
    if free == 0:
        return 0
    ids = await services.repo.claim_for_publish(
        services.registry,
        limit=free,
        republish_after=None,
        owner_max_running=services.settings.owner_max_running,
    )
    error = await publish_ids(services, ids, by="relay")
    return 0 if error else len(ids)


async def publish_ids(services: Services, ids: list[uuid.UUID], *, by: str) -> str | None:
    """Publish ids; a failure is recorded on the rows (they stay pending) and returned, not raised."""
    if not ids:
        return None
    try:
        await services.transport.publish([str(i) for i in ids])
    except Exception as exc:
        # Task owners read this (waiting_reason): the exception's class only, since its text can
        # name internal hosts and ports; the details go to the log.
        error = f"{type(exc).__name__}: the broker could not be reached"
        metrics.PUBLISH_FAILURES.inc(len(ids))
        log.warning("publishing %d task ids failed: %s: %s", len(ids), type(exc).__name__, exc)
        await services.repo.mark_publish_failed(ids, error)
        return error
    metrics.PUBLISHED.labels(by=by).inc(len(ids))
    return None
