"""The readiness fact: one short-TTL Redis key written by each reconciler run on a worker.

Its freshness proves that beat schedules, the broker delivers, a worker executes duties and
PostgreSQL answers: the chain that recovers tasks after a crash.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Any

from tasks_core.services import Services
from tasks_core.store.outcomes import ReconcileReport

READINESS_KEY = "dtask:readiness"


async def write_readiness(services: Services, report: ReconcileReport | None = None) -> None:
    fact = {"worker": services.worker_name, "written_at": time.time()}
    if report is not None:
        fact["reconcile"] = asdict(report)
    ttl = services.settings.readiness_ttl_seconds or 30.0
    await services.redis.set(READINESS_KEY, json.dumps(fact, default=str), px=int(ttl * 1000))


async def read_readiness(services: Services) -> dict[str, Any] | None:
    raw = await services.redis.get(READINESS_KEY)
    return None if raw is None else dict(json.loads(raw))
