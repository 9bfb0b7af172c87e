"""Cluster-wide runtime metrics.

Workers are many processes on many hosts, so in-process Prometheus counters would each see only
a slice. Instruments here record deltas in the process; ``flush()`` adds them to one Redis hash
(a worker every DTASK_METRICS_FLUSH_SECONDS, and when it stops), and the API renders that hash
(plus facts read from PostgreSQL) at ``/metrics``. A crash loses at most the deltas since the
last flush.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Self

METRICS_KEY = "dtask:metrics"
_deltas: defaultdict[str, float] = defaultdict(float)


def _field(name: str, labels: dict[str, str]) -> str:
    # name|k=v,k=v — label values are task types and reason codes (no '|', ',' or '=').
    return name + "|" + ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def parse_field(field: str) -> tuple[str, dict[str, str]]:
    name, _, raw = field.partition("|")
    labels = dict(part.split("=", 1) for part in raw.split(",") if "=" in part)
    return name, labels


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


class _Labelled:
    """``labels()`` gives one child per label set, kept: its field names are built once (a task's
    hot path increments several instruments), and label values (task types, reasons, write names)
    are a small, fixed set."""

    def __init__(self, labels: dict[str, str] | None) -> None:
        self._labels = labels or {}
        self._children: dict[tuple[tuple[str, str], ...], Self] = {}

    def _child(self, labels: dict[str, str]) -> Self:
        raise NotImplementedError

    def labels(self, **labels: str) -> Self:
        key = tuple(sorted(labels.items()))
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._child({**self._labels, **labels})
        return child


class Counter(_Labelled):
    def __init__(
        self, name: str, doc: str, labelnames: tuple[str, ...] = (), labels: dict[str, str] | None = None
    ):
        super().__init__(labels)
        self.name, self.doc, self.labelnames = name, doc, labelnames
        self._key = _field(name, self._labels)

    def _child(self, labels: dict[str, str]) -> Counter:
        return Counter(self.name, self.doc, self.labelnames, labels)

    def inc(self, amount: float = 1.0) -> None:
        _deltas[self._key] += amount


class Histogram(_Labelled):
    def __init__(
        self,
        name: str,
        doc: str,
        labelnames: tuple[str, ...] = (),
        buckets: tuple[float, ...] = (),
        labels: dict[str, str] | None = None,
    ):
        super().__init__(labels)
        self.name, self.doc, self.labelnames, self.buckets = name, doc, labelnames, buckets
        self._bucket_keys = [
            (bound, _field(name + "_bucket", {**self._labels, "le": _le(bound)})) for bound in buckets
        ]
        self._sum_key = _field(name + "_sum", self._labels)
        self._count_key = _field(name + "_count", self._labels)

    def _child(self, labels: dict[str, str]) -> Histogram:
        return Histogram(self.name, self.doc, self.labelnames, self.buckets, labels)

    def observe(self, value: float) -> None:
        for bound, key in self._bucket_keys:
            if value <= bound:
                _deltas[key] += 1
        _deltas[self._sum_key] += value
        _deltas[self._count_key] += 1


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
