"""Human durations for the CLI: 90, 45s, 30m, 12h, 7d, 1d12h."""

from __future__ import annotations

import math
import re

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


def parse_duration(text: str) -> float:
    raw = text.strip().lower()
    try:
        seconds = float(raw)
    except ValueError:
        parts = _PART.findall(raw)
        if not parts or "".join(n + u for n, u in parts) != raw:
            raise ValueError(f"not a duration: {text!r} (use e.g. 45s, 30m, 12h, 7d)") from None
        seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"duration must be positive and finite: {text!r}")
    return seconds
