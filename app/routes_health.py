"""Liveness, readiness and Prometheus metrics (no API key: probes and scrapers call them)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from sqlalchemy import text

from app.metrics import render_metrics
from app.schemas import Readiness
from tasks_core.readiness import read_readiness
from tasks_core.services import Services

router = APIRouter(tags=["health"])
# Each fact gets its own deadline so /readyz answers within 2 s even when a dependency hangs.
FACT_TIMEOUT = 1.5


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is alive (nothing else is checked)."""
    return {"status": "ok"}


async def _fact(check: Awaitable[str | None]) -> dict[str, Any]:
    try:
        detail = await asyncio.wait_for(check, FACT_TIMEOUT)
    except TimeoutError:
        return {"ok": False, "detail": f"no answer within {FACT_TIMEOUT} s"}
    except Exception as exc:  # a failing dependency is a fact to report, not a 500
        return {"ok": False, "detail": f"{type(exc).__name__}: {exc}"[:300]}
    return {"ok": detail is None, "detail": detail}


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


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
async def readyz(request: Request) -> Any:
    """Ready only while PostgreSQL and Redis answer and a worker reconciled recently."""
    svc: Services = request.app.state.services
    names = ("postgres", "redis", "readiness")
    results = await asyncio.gather(_fact(_postgres(svc)), _fact(_redis(svc)), _fact(_recovery(svc)))
    facts = dict(zip(names, results, strict=True))
    ready = all(f["ok"] for f in facts.values())
    return JSONResponse({"ready": ready, "facts": facts}, status_code=200 if ready else 503)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> PlainTextResponse:
    """Prometheus text format: tasks by status and type, runtime counters, queue age, durations."""
    body, content_type = await render_metrics(request.app.state.services)
    return PlainTextResponse(body, media_type=content_type)
