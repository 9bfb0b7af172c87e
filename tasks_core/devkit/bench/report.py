"""Statistics, the result document, its JSON file and the short table every workload prints.

A result is a plain dict so it can be written as JSON as is. Its shape is the same for every
workload (the smoke tests and docs/benchmarks.md rely on it)::

    workload, started_at, finished_at, elapsed_seconds, quick,
    machine  {cpu_count, ...},  settings {...every option and process setting used...},
    variants {name: {description, rounds: [{round, seq, ...metrics}], median: {...}, ...}},
    ratios   {name: float | None},  table {title, columns, rows},  notes [str]
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RESULTS_DIR = Path("bench-results")


# ----------------------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """n, median (= p50), p99, min, max and mean of a sample; empty dict for no values."""
    if not values:
        return {}
    return {
        "n": len(values),
        "median": statistics.median(values),
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "min": min(values),
        "max": max(values),
        "mean": statistics.fmean(values),
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def alternate(variants: Sequence[str], rounds: int) -> Iterator[tuple[int, int, str]]:
    """(round, sequence number, variant) in the order A, B, C, A, B, C, ...

    Alternating, rather than all A rounds then all B rounds, spreads slow drifts of the machine
    (other processes, thermal state, a growing WAL) over every variant alike.
    """
    seq = 0
    for r in range(rounds):
        for name in variants:
            yield r, seq, name
            seq += 1


class Rounds:
    """Per-variant round results, in the order they ran, with medians across rounds."""

    def __init__(self, descriptions: Mapping[str, str]) -> None:
        self.descriptions = dict(descriptions)
        self.rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in descriptions}
        self.extra: dict[str, dict[str, Any]] = {name: {} for name in descriptions}

    def add(self, variant: str, round_no: int, seq: int, data: Mapping[str, Any]) -> None:
        self.rounds[variant].append({"round": round_no, "seq": seq, **data})

    def median(self, variant: str, key: str) -> float | None:
        values = [r[key] for r in self.rounds[variant] if isinstance(r.get(key), int | float)]
        return statistics.median(values) if values else None

    def medians(self, variant: str) -> dict[str, float]:
        keys: list[str] = []
        for r in self.rounds[variant]:
            keys.extend(k for k, v in r.items() if _numeric(v) and k not in ("round", "seq", *keys))
        out: dict[str, float] = {}
        for key in keys:
            value = self.median(variant, key)
            if value is not None:
                out[key] = value
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            name: {
                "description": self.descriptions[name],
                "rounds": self.rounds[name],
                "median": self.medians(name),
                **self.extra[name],
            }
            for name in self.descriptions
        }


def _numeric(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# ----------------------------------------------------------------------------------------- document


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: cores first (the design's figures are for 2 cores)."""
    import celery
    import kombu
    import sqlalchemy

    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "celery": celery.__version__,
        "kombu": kombu.__version__,
        "sqlalchemy": sqlalchemy.__version__,
        "load_average_at_start": list(os.getloadavg()),
    }
    try:
        with open("/proc/meminfo") as f:
            total_kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        info["memory_total_mb"] = round(total_kb / 1024)
    except (OSError, StopIteration, ValueError):
        pass
    return info


class Document:
    """Collects one run's result; ``finish()`` returns the dict written to JSON."""

    def __init__(self, workload: str, settings: Mapping[str, Any], *, quick: bool) -> None:
        self.workload = workload
        self.started = datetime.now(UTC)
        self._t0 = time.monotonic()
        self.data: dict[str, Any] = {
            "workload": workload,
            "started_at": self.started.isoformat(),
            "quick": quick,
            "machine": machine_info(),
            "settings": dict(settings),
            "variants": {},
            "ratios": {},
            "table": {"title": workload, "columns": [], "rows": []},
            "notes": [],
        }

    @property
    def settings(self) -> dict[str, Any]:
        settings: dict[str, Any] = self.data["settings"]
        return settings

    def note(self, text: str) -> None:
        self.data["notes"].append(text)

    def table(self, title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
        self.data["table"] = {"title": title, "columns": list(columns), "rows": [list(r) for r in rows]}

    def finish(self) -> dict[str, Any]:
        self.data["finished_at"] = datetime.now(UTC).isoformat()
        self.data["elapsed_seconds"] = round(time.monotonic() - self._t0, 3)
        self.data["machine"]["load_average_at_end"] = list(os.getloadavg())
        return self.data


def default_out(workload: str, started: str | None = None) -> Path:
    stamp = (datetime.fromisoformat(started) if started else datetime.now(UTC)).strftime("%Y%m%d-%H%M%S")
    return RESULTS_DIR / f"{workload}-{stamp}.json"


def write_result(result: Mapping[str, Any], out: Path | None) -> Path:
    path = out or default_out(str(result["workload"]), str(result.get("started_at")))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return path


def fmt(value: Any) -> str:
    """Numbers for people: 3 significant digits for small values, thousands separators for big ones."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int) or abs(value) >= 1000:
        return f"{value:,.0f}"
    if value == 0:
        return "0"
    return f"{value:.3g}"


def print_table(result: Mapping[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    spec = result["table"]
    machine = result["machine"]
    table = Table(title=f"{spec['title']}  ({machine['cpu_count']} cores)")
    for i, column in enumerate(spec["columns"]):
        table.add_column(column, justify="right" if i else "left", no_wrap=not i)
    for row in spec["rows"]:
        table.add_row(*(fmt(v) for v in row))
    console = Console()
    console.print(table)
    for name, value in result.get("ratios", {}).items():
        console.print(f"  {name}: {fmt(value)}")
    for note in result.get("notes", []):
        console.print(f"  note: {note}", style="dim")
