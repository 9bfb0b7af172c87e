"""Process-local Prometheus instruments of the runtime (the API also exports database facts)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

CLAIMS = Counter("dtask_claims", "Successful claims")
CLAIM_REFUSED = Counter("dtask_claims_refused", "Messages dropped because the claim was refused", ["reason"])
LEASE_LOST = Counter("dtask_lease_lost", "Attempts that lost ownership before finishing")
RECONCILED = Counter("dtask_reconciled", "Tasks converged by the reconciler", ["kind"])
PUBLISH_FAILURES = Counter("dtask_publish_failures", "Task ids that could not be published")
PUBLISHED = Counter("dtask_published", "Task ids published", ["by"])
HANDLER_SECONDS = Histogram(
    "dtask_handler_seconds", "Handler run time", ["task_type"],
    buckets=(0.01, 0.1, 1, 10, 60, 300, 1800, 3600, 4 * 3600, 24 * 3600, float("inf")),
)
