"""Reconciler duty: converge expired leases (failed `lease_expired` with the failure hook, or back
to pending for a retry-safe handler with attempts left), legacy v0 rows and unrunnable versions.
Every run relays what is due and refreshes the readiness fact: a worker that can reconcile is a
worker that can recover tasks."""

from __future__ import annotations

from functools import partial

from tasks_core import metrics
from tasks_core.duties.readiness import write_readiness
from tasks_core.duties.relay import relay
from tasks_core.retry import backoff
from tasks_core.services import Services
from tasks_core.store.outcomes import ReconcileReport


def retry_delay(services: Services) -> object:
    return partial(backoff, services.settings)


async def reconcile(services: Services) -> ReconcileReport:
    s = services.settings
    report = await services.repo.reconcile(
        services.registry,
        batch=s.reconcile_batch,
        retry_delay=retry_delay(services),
        stalled_after=services.lease.stalled_after_seconds,
    )
    for kind in ("failed", "retried", "cancelled", "legacy", "unrunnable", "hook_errors"):
        if getattr(report, kind):
            metrics.RECONCILED.labels(kind=kind).inc(getattr(report, kind))
    # Converged tasks freed slots; and a task sent back to pending with a backoff (by this or an
    # earlier pass, or by its owner) is due once it has passed: every pass hands them on (one
    # statement), so a retry waits for its backoff and at most one interval, not for the publisher.
    await relay(services)
    await write_readiness(services, report)
    return report
