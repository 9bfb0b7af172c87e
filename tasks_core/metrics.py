"""Cluster-wide runtime metrics.

Workers are many processes on many hosts, so in-process Prometheus counters would each see only
a slice. Instruments here record deltas in the process; ``flush()`` adds them to one Redis hash
after each task and duty, and the API renders that hash (plus facts read from PostgreSQL) at
``/metrics``. A crash loses at most the deltas of the run in flight.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

METRICS_KEY = "dtask:metrics"
_deltas: defaultdict[str, float] = defaultdict(float)


def _field(name: str, labels: dict[str, str]) -> str:
    # name|k=v,k=v — label values are task types and reason codes (no '|', ',' or '=').
    return name + "|" + ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def parse_field(field: str) -> tuple[str, dict[str, str]]:
    name, _, raw = field.partition("|")
    labels = dict(part.split("=", 1) for part in raw.split(",") if "=" in part)
    return name, labels


class Counter:
    def __init__(
        self, name: str, doc: str, labelnames: tuple[str, ...] = (), labels: dict[str, str] | None = None
    ):
        self.name, self.doc, self.labelnames = name, doc, labelnames
        self._labels = labels or {}

    def labels(self, **labels: str) -> Counter:
        return Counter(self.name, self.doc, self.labelnames, {**self._labels, **labels})

    def inc(self, amount: float = 1.0) -> None:
        _deltas[_field(self.name, self._labels)] += amount


class Histogram:
    def __init__(
        self,
        name: str,
        doc: str,
        labelnames: tuple[str, ...] = (),
        buckets: tuple[float, ...] = (),
        labels: dict[str, str] | None = None,
    ):
        self.name, self.doc, self.labelnames, self.buckets = name, doc, labelnames, buckets
        self._labels = labels or {}

    def labels(self, **labels: str) -> Histogram:
        return Histogram(self.name, self.doc, self.labelnames, self.buckets, {**self._labels, **labels})

    def observe(self, value: float) -> None:
        for bound in self.buckets:
            if value <= bound:
                le = "+Inf" if math.isinf(bound) else repr(float(bound))
                _deltas[_field(self.name + "_bucket", {**self._labels, "le": le})] += 1
        _deltas[_field(self.name + "_sum", self._labels)] += value
        _deltas[_field(self.name + "_count", self._labels)] += 1


CLAIMS = Counter("dtask_claims", "Successful claims")
CLAIM_REFUSED = Counter("dtask_claims_refused", "Messages dropped because the claim was refused", ("reason",))
LEASE_LOST = Counter("dtask_lease_lost", "Attempts that lost ownership before finishing")
# A fenced write (heartbeat, report, owning transaction, terminal write, hand-back) that found its
# attempt no longer owns the task and so wrote nothing: proof that fencing stopped a late writer.
FENCED_WRITES_REJECTED = Counter(
    "dtask_fenced_writes_rejected", "Fenced writes refused because the attempt no longer owned the task",
    ("write",),
)
RECONCILED = Counter("dtask_reconciled", "Tasks converged by the reconciler", ("kind",))
PUBLISH_FAILURES = Counter("dtask_publish_failures", "Task ids that could not be published")
PUBLISHED = Counter("dtask_published", "Task ids published", ("by",))
# DTASK_WORKER_RUN_NEXT: ids a terminal write picked that its own process went on to claim itself.
RUN_NEXT = Counter("dtask_run_next", "Tasks a worker process went on to itself, without a message")
HANDLER_SECONDS = Histogram(
    "dtask_handler_seconds",
    "Handler run time",
    ("task_type",),
    buckets=(0.01, 0.1, 1, 10, 60, 300, 1800, 3600, 4 * 3600, 24 * 3600, math.inf),
)
COUNTERS = (
    CLAIMS, CLAIM_REFUSED, LEASE_LOST, FENCED_WRITES_REJECTED, RECONCILED, PUBLISH_FAILURES, PUBLISHED,
    RUN_NEXT,
)
HISTOGRAMS = (HANDLER_SECONDS,)


async def flush(redis: Any) -> None:
    """Add this process's deltas to the shared hash; on failure they are kept for the next flush."""
    if not _deltas:
        return
    pending = dict(_deltas)
    _deltas.clear()
    try:
        pipe = redis.pipeline(transaction=False)
        for field, delta in pending.items():
            pipe.hincrbyfloat(METRICS_KEY, field, delta)
        await pipe.execute()
    except Exception:
        for field, delta in pending.items():
            _deltas[field] += delta
        raise


async def read(redis: Any) -> dict[str, float]:
    raw = await redis.hgetall(METRICS_KEY)
    return {k.decode() if isinstance(k, bytes) else k: float(v) for k, v in raw.items()}
