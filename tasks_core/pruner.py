"""Pruner duty: delete terminal tasks (and their attempts) older than a given age."""

from __future__ import annotations

from tasks_core.services import Services

# The broker-driven duty never prunes tasks younger than this unless DTASK_PRUNE_AFTER_SECONDS says
# so (`dtask prune` on the command line is the operator's own choice and has no floor).
MIN_PRUNE_AGE_SECONDS = 86400.0


async def prune(services: Services, older_than_seconds: float) -> int:
    return await services.repo.prune(older_than_seconds)
