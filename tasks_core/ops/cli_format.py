"""How `dtask show` and `dtask list` print a task for a person (``--json`` prints the HTTP object)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

LIST_HEADER = f"{'ID':<36}  {'STATUS':<9}  {'PROGRESS':>8}  {'TYPE':<24}  CREATED"


def number(value: float) -> str:
    """6.666666666666667 -> '6.7', 50.0 -> '50'."""
    return f"{value:.1f}".removesuffix(".0")


def percent(value: float) -> str:
    return f"{number(value)}%"


def duration(seconds: float) -> str:
    """3600 -> '1h', 5400 -> '1h 30m', 45.5 -> '45.5s'."""
    if seconds < 60:
        return f"{number(seconds)}s"
    whole = round(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        amount, whole = divmod(whole, size)
        if amount:
            parts.append(f"{amount}{unit}")
    return " ".join(parts)


def timestamp(iso: str) -> str:
    """'2026-11-30T16:53:07.083147Z' -> '2026-11-30 16:53:07 UTC'."""
    return datetime.fromisoformat(iso).strftime("%Y-%m-%d %H:%M:%S UTC")


def list_row(view: dict[str, Any]) -> str:
    return (
        f"{view['id']:<36}  {view['status']:<9}  {percent(view['progress']):>8}  "
        f"{view['task_type']:<24}  {timestamp(view['created_at'])}"
    )


def show_lines(view: dict[str, Any]) -> list[str]:
    """One 'label  value' line per field that has something to say; empty fields are left out."""
    fields: list[tuple[str, str | None]] = [
        ("id", view["id"]),
        ("type", f"{view['task_type']} (version {view['handler_version']})"),
        ("status", view["status"]),
        ("waiting", view["waiting_reason"]),
        ("progress", percent(view["progress"])),
        ("message", view["message"]),
        ("result", _json(view["result"])),
        ("error", _error(view["error"])),
        ("attempts", str(view["attempt_count"])),
        ("cancel", "requested" if view["cancel_requested"] else None),
        ("dedupe key", view["dedupe_key"]),
        ("timeout", duration(view["timeout_seconds"]) if view["timeout_seconds"] is not None else None),
        ("created", _time(view["created_at"])),
        ("started", _time(view["started_at"])),
        ("finished", _time(view["finished_at"])),
        ("lease until", _time(view["lease_expires_at"])),
    ]
    return [f"{label:<12} {value}" for label, value in fields if value not in (None, "")]


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False)


def _error(error: dict[str, Any] | None) -> str | None:
    return None if not error else f"{error.get('code')}: {error.get('message')}"


def _time(iso: str | None) -> str | None:
    return None if iso is None else timestamp(iso)
