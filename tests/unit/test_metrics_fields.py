"""Metric instruments record their deltas under the fields the api parses back (name|k=v,...)."""

from __future__ import annotations

from collections.abc import Callable

from tasks_core import metrics


def _recorded(action: Callable[[], object]) -> dict[str, float]:
    before = dict(metrics._deltas)
    action()
    return {k: v - before.get(k, 0.0) for k, v in metrics._deltas.items() if v != before.get(k, 0.0)}


def test_a_labelled_counter_records_under_its_sorted_labels_each_time() -> None:
    counter = metrics.Counter("t_total", "test", ("b", "a"))
    child = counter.labels(b="2", a="1")
    assert counter.labels(a="1", b="2") is child  # the field is built once per label set
    assert _recorded(lambda: (child.inc(), counter.labels(a="1", b="2").inc(2))) == {"t_total|a=1,b=2": 3.0}
    assert _recorded(lambda: counter.labels(a="x", b="2").inc()) == {"t_total|a=x,b=2": 1.0}


def test_a_histogram_counts_every_bucket_at_or_above_the_value() -> None:
    hist = metrics.Histogram("t_seconds", "test", ("kind",), buckets=(0.1, 1.0, float("inf")))
    got = _recorded(lambda: hist.labels(kind="k").observe(0.5))
    assert got == {
        "t_seconds_bucket|kind=k,le=1.0": 1.0, "t_seconds_bucket|kind=k,le=+Inf": 1.0,
        "t_seconds_sum|kind=k": 0.5, "t_seconds_count|kind=k": 1.0,
    }
    for name, labels in (metrics.parse_field(k) for k in got):
        assert name.startswith("t_seconds") and labels["kind"] == "k"
