"""The bodies of the duties' Celery tasks (``dtask.publish``, ``dtask.reconcile``, ``dtask.prune``,
``dtask.schedule``, ``dtask.duty``): what a duty message may ask, checked, then the duty run.
Anyone who can write to the broker can send these messages, so an argument is never trusted."""

from __future__ import annotations

import logging
import math
from typing import Any

from tasks_core import logs
from tasks_core.duties.pruner import prune as run_prune
from tasks_core.duties.publisher import publish_pending
from tasks_core.duties.reconciler import reconcile as run_reconcile
from tasks_core.duties.scheduler import fire_due
from tasks_core.services import Services

log = logging.getLogger(__name__)


async def publish(services: Services) -> dict[str, int]:
    return vars(await publish_pending(services))


async def schedule(services: Services) -> dict[str, int]:
    return vars(await fire_due(services))


async def reconcile(services: Services) -> dict[str, Any]:
    return vars(await run_reconcile(services))


def prune_request(older_than_seconds: Any) -> tuple[bool, float | None]:
    """Whether a prune message is well formed, and the age it asks for (None: the retention)."""
    if older_than_seconds is None:
        return True, None
    if (
        not isinstance(older_than_seconds, int | float)
        or isinstance(older_than_seconds, bool)
        or not math.isfinite(older_than_seconds)
    ):
        log.warning("dropping prune message with bad age %s", logs.short(older_than_seconds))
        return False, None
    return True, float(older_than_seconds)


async def prune(services: Services, requested: float | None) -> dict[str, int]:
    """Forget expired Idempotency-Keys; delete terminal tasks older than the retention
    (DTASK_PRUNE_AFTER_SECONDS). A message may ask for an older cutoff, never a younger one: anyone
    who can write to the broker could otherwise wipe the history (prune(1e-9))."""
    return vars(await run_prune(services, requested))


async def duty(services: Services, name: Any) -> Any:
    """A domain's periodic duty (TaskSpec modules' DUTIES), by name; an unknown name is dropped."""
    fn = services.registry.duty(name) if isinstance(name, str) else None
    if fn is None:
        log.warning("dropping duty message for unknown duty %s", logs.short(name))
        return {}
    return await fn(services)
