"""Relay: hand free capacity to the oldest pending tasks that have no message in flight, at once,
so normal capacity turnover never waits for the periodic publisher. Runs after every terminal
write, after a refused claim, after the reconciler freed slots, and after each submission."""

from __future__ import annotations

import logging
import uuid
from collections import defaultdict
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncConnection

from tasks_core import metrics
from tasks_core.services import Services
from tasks_core.store.outcomes import RelayOptions
from tasks_core.transport import DURABLE_QUEUE

log = logging.getLogger(__name__)


@dataclass
class Relayed:
    ids: list[uuid.UUID] = field(default_factory=list)  # the ids sent
    error: str | None = None  # the publish failed: these ids stay pending, marked for re-sending


async def relay(services: Services, *, by: str = "relay") -> Relayed:
    """Publish what capacity can take now (see TaskStore.take_due)."""
    return await publish_due(services, await take_relay_due(services), by=by)


async def take_relay_due(
    services: Services, conn: AsyncConnection | None = None, *, republish_after: float | None = None
) -> list[tuple[uuid.UUID, str]]:
    """Stamp what capacity can take now; in ``conn``'s transaction if given (publish after commit).
    With ``republish_after`` (the publisher) also the tasks sent longer ago than that."""
    o = relay_options(services)
    return await services.repo.take_due(
        o.registry,
        capacity=o.capacity,
        ahead=o.ahead,
        window=o.window,
        limit=o.limit,
        republish_after=republish_after,
        owner_max_running=o.owner_max_running,
        conn=conn,
    )


def relay_options(services: Services) -> RelayOptions:
    """The relay's budget from the settings, the one every hand-out uses: a relay of its own, a
    terminal write's, a submission's and the publisher's."""
    s = services.settings
    return RelayOptions(
        services.registry, capacity=s.capacity, ahead=s.ahead, window=s.publish_seconds,
        limit=s.publish_batch, owner_max_running=s.owner_running_limit,
    )


async def publish_due(services: Services, due: list[tuple[uuid.UUID, str]], *, by: str) -> Relayed:
    """Publish (id, type) pairs, each on its type's queue."""
    queues: defaultdict[str, list[uuid.UUID]] = defaultdict(list)
    for task_id, task_type in due:
        queues[services.registry.queue_of(task_type)].append(task_id)
    sent: list[uuid.UUID] = []
    error = None
    for queue, ids in queues.items():
        failure = await publish_ids(services, ids, by=by, queue=queue)
        if failure is None:
            sent += ids
        error = error or failure
    return Relayed(sent, error)


async def publish_ids(
    services: Services, ids: list[uuid.UUID], *, by: str, queue: str = DURABLE_QUEUE
) -> str | None:
    """Publish ids; a failure is recorded on the rows (they stay pending) and returned, not raised."""
    if not ids:
        return None
    try:
        await services.transport.publish([str(i) for i in ids], queue)
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
