"""Pruner duty: delete terminal tasks (and their attempts) older than a given age."""

from __future__ import annotations

from tasks_core.services import Services


async def prune(services: Services, older_than_seconds: float) -> int:
    return await services.repo.prune(older_than_seconds)
