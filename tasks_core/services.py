"""The per-process bundle every duty and the runtime use: engine, repository, registry, transport."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis.asyncio as aioredis
from sqlalchemy.ext.asyncio import AsyncEngine

from tasks_core.db import make_engine
from tasks_core.registry import Registry, default_registry
from tasks_core.settings import Settings
from tasks_core.store.facade import TaskStore
from tasks_core.store.group_commit import GroupCommit
from tasks_core.transport import CeleryTransport
from tasks_core.worker.lease import LeasePolicy


class Transport(Protocol):
    """Carries task ids to workers. Raises on failure; the pending row stays the truth."""

    async def publish(self, task_ids: list[str], queue: str = ...) -> None: ...


@dataclass
class Services:
    settings: Settings
    engine: AsyncEngine
    repo: TaskStore
    registry: Registry
    transport: Transport
    worker_name: str = field(default_factory=socket.gethostname)
    _redis: aioredis.Redis | None = None
    # Concurrent single submissions of this process share a transaction (Submitter.submit).
    submit_group: GroupCommit[Any, Any] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def lease(self) -> LeasePolicy:
        return LeasePolicy.of(self.settings)

    @property
    def redis(self) -> aioredis.Redis:
        if self._redis is None:
            url = self.settings.redis_url or self.settings.require_broker()
            self._redis = aioredis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        return self._redis

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
        await self.engine.dispose()


def build_services(
    settings: Settings,
    transport: Transport | None = None,
    *,
    registry: Registry | None = None,
    pool_size: int = 5,
    extra: dict[str, Any] | None = None,
    statement_seconds: float | None = None,
    max_overflow: int = 5,
    pool_wait_seconds: float | None = None,
    plan_cache_mode: str | None = None,
) -> Services:
    """The engine's statements get ``statement_seconds`` each (default: the lease policy's bound).
    Without ``transport``, ids go through the process's publishing app."""
    lease = LeasePolicy.of(settings)
    deadline = statement_seconds or lease.statement_seconds
    engine = make_engine(
        settings.require_database(),
        pool_size=pool_size,
        idle_in_transaction_seconds=lease.idle_in_transaction_seconds,
        statement_seconds=deadline,
        connect_seconds=min(5.0, deadline),
        max_overflow=max_overflow,
        pool_wait_seconds=pool_wait_seconds,
        plan_cache_mode=plan_cache_mode,
    )
    return Services(
        settings=settings,
        engine=engine,
        repo=TaskStore(engine),
        registry=registry or default_registry(settings.extra_modules),
        transport=transport or CeleryTransport(timeout=settings.publish_timeout_seconds),
        **(extra or {}),
    )
