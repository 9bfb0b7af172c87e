"""Liveness, readiness and Prometheus metrics (no API key: probes and scrapers call them)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sqlalchemy import text

from app.auth import UNAUTHORIZED, bearer_token
from app.metrics import CONTENT_TYPE, MetricsCache
from app.schemas import Readiness
from tasks_core.duties.readiness import read_readiness
from tasks_core.services import Services

log = logging.getLogger(__name__)
router = APIRouter(tags=["health"])
# Each fact gets its own deadline so /readyz answers within 2 s even when a dependency hangs.
FACT_TIMEOUT = 1.5


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is alive (nothing else is checked)."""
    return {"status": "ok"}


async def _fact(name: str, check: Coroutine[Any, Any, str | None]) -> dict[str, Any]:
    # Anyone may call /readyz: it names the failing fact, and the exception (role names, hosts,
    # driver internals) goes to the log only.
    # Not wait_for: cancelling a call stuck on a paused server can itself hang (asyncpg's cancel
    # request goes to the same server). The check is left to end on its own statement deadline.
    task = asyncio.ensure_future(check)
    task.add_done_callback(_consume)
    done, _ = await asyncio.wait({task}, timeout=FACT_TIMEOUT)
    if not done:
        log.warning("readiness: %s gave no answer within %s s", name, FACT_TIMEOUT)
        return {"ok": False, "detail": f"no answer within {FACT_TIMEOUT} s"}
    if task.exception() is not None:  # a failing dependency is a fact to report, not a 500
        log.warning("readiness: %s failed", name, exc_info=task.exception())
        return {"ok": False, "detail": "unreachable or refused (details in the api log)"}
    detail = task.result()
    return {"ok": detail is None, "detail": detail}


def _consume(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a late failure is not "never retrieved" noise


async def _postgres(svc: Services) -> str | None:
    async with svc.engine.connect() as conn:
        await conn.execute(text("SELECT 1"))
    return None


async def _redis(svc: Services) -> str | None:
    await svc.redis.ping()
    return None


async def _recovery(svc: Services) -> str | None:
    fact = await read_readiness(svc)
    if fact is None:
        return "no fresh readiness fact: no worker has reconciled recently (are beat and a worker running?)"
    age = time.time() - float(fact.get("written_at", 0))
    ttl = svc.settings.readiness_ttl_seconds or 30.0
    if age > ttl:
        return f"readiness fact is stale ({age:.0f} s old)"
    return None


# A fact a domain adds to readiness (``app.state.readiness_facts``: name -> check). Unlike the core
# facts it may be ok and still say something (a store that is not configured).
ContributedFact = Callable[[Services], Coroutine[Any, Any, tuple[bool, str | None]]]


async def _contributed(name: str, check: Coroutine[Any, Any, tuple[bool, str | None]]) -> dict[str, Any]:
    task = asyncio.ensure_future(check)
    task.add_done_callback(_consume)
    done, _ = await asyncio.wait({task}, timeout=FACT_TIMEOUT)
    if not done:
        log.warning("readiness: %s gave no answer within %s s", name, FACT_TIMEOUT)
        return {"ok": False, "detail": f"no answer within {FACT_TIMEOUT} s"}
    if task.exception() is not None:
        log.warning("readiness: %s failed", name, exc_info=task.exception())
        return {"ok": False, "detail": "unreachable or refused (details in the api log)"}
    ok, detail = task.result()
    return {"ok": ok, "detail": detail}


async def readiness_facts(
    svc: Services, extra: Mapping[str, ContributedFact] | None = None
) -> dict[str, dict[str, Any]]:
    """Each fact /readyz judges by, ``{"ok": bool, "detail": str | None}``, within FACT_TIMEOUT."""
    extra = extra or {}
    names = ("postgres", "redis", "readiness", *extra)
    results = await asyncio.gather(
        _fact("postgres", _postgres(svc)), _fact("redis", _redis(svc)), _fact("readiness", _recovery(svc)),
        *(_contributed(name, check(svc)) for name, check in extra.items()),
    )
    return dict(zip(names, results, strict=True))


def domain_facts(request: Request) -> Mapping[str, ContributedFact]:
    facts: Mapping[str, ContributedFact] = getattr(request.app.state, "readiness_facts", {})
    return facts


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
async def readyz(request: Request) -> Any:
    """Ready only while PostgreSQL and Redis answer and a worker reconciled recently (and the
    stores a domain relies on, when configured, answer)."""
    facts = await readiness_facts(request.app.state.services, domain_facts(request))
    ready = all(f["ok"] for f in facts.values())
    return JSONResponse({"ready": ready, "facts": facts}, status_code=200 if ready else 503)


def _metrics_allowed(request: Request) -> bool:
    token = bearer_token(request.scope["headers"])
    if not token:
        return False
    expected = request.app.state.services.settings.metrics_token
    if expected and hmac.compare_digest(expected.encode(), token.encode()):
        return True
    found = request.app.state.keys.authenticate(token)
    return bool(found is not None and found.admin)


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE: {}}}, 401: {"description": "Missing or wrong token"}},
)
async def metrics(request: Request) -> Response:
    """Prometheus text format: tasks by status and type, runtime counters, queue age, durations.

    Needs `Authorization: Bearer <DTASK_METRICS_TOKEN>` or an admin API key (the figures name
    every tenant's task types). Served from a cache of at most DTASK_METRICS_CACHE_SECONDS.
    """
    if not _metrics_allowed(request):
        raise UNAUTHORIZED
    cache: MetricsCache = request.app.state.metrics_cache
    return Response(await cache.get(request.app.state.services), media_type=CONTENT_TYPE)
