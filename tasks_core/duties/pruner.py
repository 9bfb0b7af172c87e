"""Pruner duty (scheduled hourly by beat, run by a worker): forget Idempotency-Keys past their
24 hours, and delete terminal tasks (and their attempts) older than the configured retention."""

from __future__ import annotations

from dataclasses import dataclass

from tasks_core.services import Services

# A broker message may ask for an older cutoff than the retention, never a younger one; with no
# retention configured, never younger than this (`dtask prune` on the command line is the
# operator's own choice and has no floor).
MIN_PRUNE_AGE_SECONDS = 86400.0


@dataclass
class PruneReport:
    tasks: int
    idempotency_keys: int


def prune_age(configured: float | None, requested: float | None) -> float | None:
    """The age beyond which terminal tasks go: the retention, or what a message asked if older."""
    if requested is None:
        return configured
    return max(requested, configured or MIN_PRUNE_AGE_SECONDS)


async def prune(services: Services, requested_age: float | None = None) -> PruneReport:
    age = prune_age(services.settings.prune_after_seconds, requested_age)
    tasks = await services.repo.prune(age) if age is not None else 0
    return PruneReport(tasks=tasks, idempotency_keys=await services.repo.prune_idempotency_keys())
