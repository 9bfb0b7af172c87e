"""The FastAPI application (`dtask api`, or `uvicorn --factory app.main:create_app`, best with
`--http app.server:DeadlineProtocol --limit-concurrency N`, as `dtask api` runs it)."""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from app import routes_health, routes_schedules, routes_tasks, routes_types, ui
from app.auth import BodyRoute, Guard, KeyRing
from app.cache import TtlCache
from app.metrics import MetricsCache
from app.routes_health import ContributedFact
from tasks_core.db import check_schema, is_transient
from tasks_core.domain import Domain, load_domains
from tasks_core.registry import import_path
from tasks_core.services import Services, build_services
from tasks_core.settings import Settings, get_settings

DESCRIPTION = """Durable background tasks. PostgreSQL owns every task's state and lease; workers
claim tasks under a fresh attempt token. Authenticate with `Authorization: Bearer <secret>`
(keys from `DTASK_API_KEYS`); a key sees only the tasks it submitted unless it is an admin key."""


log = logging.getLogger(__name__)
RETRY_AFTER_SECONDS = 5
# Answer without a key: probes, and the OpenAPI document (its routes still need a key).
PUBLIC_PATHS = ("/healthz", "/readyz", "/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc")
# Routes that check credentials themselves (the metrics token; the dashboard's sign-in cookie).
OWN_AUTH_PREFIXES = ("/metrics", "/ui")


def _safe_scalar(value: Any) -> Any:
    """An echoed input as JSON can carry it: no Infinity/NaN (Python's parser accepts them), no
    lone surrogates (they cannot be encoded), no containers (a deep one would recurse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str):
        return value[:200].encode("utf-8", "backslashreplace").decode("utf-8")
    if value is None or isinstance(value, bool | int | float):
        return value
    return None


async def _dependency_error(request: Request, exc: Exception) -> JSONResponse:
    """PostgreSQL or Redis unreachable (or too slow): 503 naming which, never a 500 or a hang."""
    if not (is_transient(exc) or isinstance(exc, RedisError)):
        raise exc
    dependency = "redis" if isinstance(exc, RedisError) else "postgres"
    log.warning("%s %s: %s unavailable: %s", request.method, request.url.path, dependency, type(exc).__name__)
    return JSONResponse(
        status_code=503,
        content={"detail": f"{dependency} is unavailable; try again shortly", "dependency": dependency},
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = []
    for error in exc.errors():
        entry = {k: error[k] for k in ("loc", "msg", "type") if k in error}
        entry["msg"] = _safe_scalar(str(entry.get("msg", "")))
        entry["loc"] = [_safe_scalar(part) for part in entry.get("loc", ())]
        if "input" in error and _safe_scalar(error["input"]) is not None:
            entry["input"] = _safe_scalar(error["input"])
        errors.append(entry)
    return JSONResponse(status_code=422, content={"detail": errors})


def _install_domains(app: FastAPI, settings: Settings, domains: tuple[Domain, ...]) -> list[BodyRoute]:
    """Each declared domain's routes, their error answers and readiness facts; returns the routes
    whose bodies may exceed the default limit (uploads). The api knows domains only from this list."""
    facts: dict[str, ContributedFact] = {}
    body_routes: list[BodyRoute] = []
    for domain in domains:
        if domain.api is not None:
            part = import_path(domain.api)
            app.include_router(part if isinstance(part, APIRouter) else part())
        for error, handler in domain.api_errors.items():
            app.add_exception_handler(import_path(error), import_path(handler))
        facts.update({name: import_path(check) for name, check in domain.readiness.items()})
        if domain.path_limits is not None:
            body_routes.extend(import_path(domain.path_limits)(settings))
    app.state.readiness_facts = facts  # read by /readyz beside the core facts
    return body_routes


def create_app(settings: Settings | None = None, services: Services | None = None) -> FastAPI:
    settings = settings or (services.settings if services else get_settings())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        own = services is None
        svc = services or build_services(
            settings, pool_size=10, statement_seconds=settings.api_database_timeout_seconds,
            pool_wait_seconds=settings.api_pool_wait_seconds,
        )
        if own:
            await check_schema(svc.engine)  # fail closed before serving anything
        app.state.services = svc
        try:
            yield
        finally:
            if own:
                await svc.close()

    app = FastAPI(title="durable-tasks", version="0.1.0", description=DESCRIPTION, lifespan=lifespan)
    app.state.keys = KeyRing(settings.api_keys)
    app.state.metrics_cache = MetricsCache(settings.metrics_cache_seconds)
    app.state.summary_cache = TtlCache[dict[str, Any]](settings.metrics_cache_seconds)
    if services is not None:
        app.state.services = services
    app.add_exception_handler(RequestValidationError, _validation_error)
    for kind in (DBAPIError, PoolTimeout, OSError, TimeoutError, RedisError):
        app.add_exception_handler(kind, _dependency_error)
    app.include_router(routes_tasks.router)
    app.include_router(routes_types.router)
    app.include_router(routes_schedules.router)
    ui.install(app, settings)  # the dashboard at /ui (signs in by cookie, hence OWN_AUTH_PREFIXES)
    app.include_router(routes_health.router)
    body_routes = _install_domains(app, settings, load_domains())
    # Authenticate before reading any body; a batch may carry up to 1,000 payloads (each also
    # checked against its own limit). Only the routes a domain names (uploads) take larger bodies.
    app.add_middleware(
        Guard,
        keys=app.state.keys,
        limit=settings.max_request_bytes,
        body_timeout=settings.api_body_timeout_seconds,
        public=PUBLIC_PATHS,
        own_auth=OWN_AUTH_PREFIXES,
        routes=body_routes,
    )
    return app
