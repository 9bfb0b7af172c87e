"""Render /metrics from PostgreSQL facts and the runtime's shared counters in Redis.

The figures are cached for DTASK_METRICS_CACHE_SECONDS and refreshed by one request at a time:
forty concurrent scrapes cost one summary query, not forty.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import defaultdict
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from app.cache import TtlCache
from tasks_core import metrics as runtime_metrics
from tasks_core.domain import load_domains
from tasks_core.registry import import_path
from tasks_core.services import Services

# A paused Redis costs a scrape at most this long per call.
REDIS_SECONDS = 0.5


@functools.cache
def instruments() -> tuple[tuple[runtime_metrics.Counter, ...], tuple[runtime_metrics.Histogram, ...]]:
    """The runtime's counters and histograms, then each domain's (its ``Domain.metrics``)."""
    found = [import_path(path) for domain in load_domains() for path in domain.metrics]
    for instrument in found:
        if not isinstance(instrument, runtime_metrics.Counter | runtime_metrics.Histogram):
            raise TypeError(f"{instrument!r} in a Domain.metrics is not a tasks_core.metrics instrument")
    counters = [i for i in found if isinstance(i, runtime_metrics.Counter)]
    histograms = [i for i in found if isinstance(i, runtime_metrics.Histogram)]
    return (*runtime_metrics.COUNTERS, *counters), (*runtime_metrics.HISTOGRAMS, *histograms)


class _Snapshot:
    """A one-shot collector over values fetched (asynchronously) just before rendering."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> Any:
        return iter(self.families)


class MetricsCache:
    def __init__(self, max_age: float) -> None:
        self._cache = TtlCache[bytes](max_age, max_keys=1)

    async def get(self, svc: Services) -> bytes:
        body, _age = await self._cache.get("metrics", lambda: render_metrics(svc))
        return body


async def render_metrics(svc: Services) -> bytes:
    # This process's own counts (publishes at submit) join the shared ones before rendering.
    with contextlib.suppress(Exception):  # on failure the deltas wait for the next flush
        await asyncio.wait_for(runtime_metrics.flush(svc.redis), REDIS_SECONDS)
    summary = await svc.repo.summary()
    oldest = await svc.repo.oldest_pending_age()
    try:  # the shared counters are lost for this scrape only; the database figures still serve
        shared = await asyncio.wait_for(runtime_metrics.read(svc.redis), REDIS_SECONDS)
    except Exception:
        shared = {}

    tasks = GaugeMetricFamily("dtask_tasks", "Tasks by status and type", labels=["status", "task_type"])
    for task_type, counts in sorted(summary["by_type"].items()):
        for status, count in sorted(counts.items()):
            tasks.add_metric([status, task_type], count)
    age = GaugeMetricFamily("dtask_oldest_pending_age_seconds", "Age of the oldest pending task (0 if none)")
    age.add_metric([], oldest or 0.0)
    families: list[Any] = [tasks, age]

    by_name: defaultdict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for field, value in shared.items():
        name, labels = runtime_metrics.parse_field(field)
        by_name[name].append((labels, value))
    counters, histograms = instruments()
    for counter in counters:
        family = CounterMetricFamily(counter.name, counter.doc, labels=list(counter.labelnames))
        for labels, value in by_name.get(counter.name, []):
            family.add_metric([labels.get(k, "") for k in counter.labelnames], value)
        families.append(family)
    for hist in histograms:
        families.append(_histogram(hist, by_name))

    registry = CollectorRegistry()
    registry.register(_Snapshot(families))  # type: ignore[arg-type]
    return generate_latest(registry)


CONTENT_TYPE = CONTENT_TYPE_LATEST


def _histogram(
    hist: runtime_metrics.Histogram, by_name: dict[str, list[tuple[dict[str, str], float]]]
) -> Any:
    family = HistogramMetricFamily(hist.name, hist.doc, labels=list(hist.labelnames))
    series: defaultdict[tuple[str, ...], dict[str, Any]] = defaultdict(lambda: {"buckets": {}, "sum": 0.0})
    for labels, value in by_name.get(hist.name + "_bucket", []):
        key = tuple(labels.get(k, "") for k in hist.labelnames)
        series[key]["buckets"][labels["le"]] = value
    for labels, value in by_name.get(hist.name + "_sum", []):
        series[tuple(labels.get(k, "") for k in hist.labelnames)]["sum"] = value
    for key, data in sorted(series.items()):
        buckets = sorted(data["buckets"].items(), key=lambda kv: float(kv[0]))
        family.add_metric(list(key), buckets=buckets, sum_value=data["sum"])
    return family
