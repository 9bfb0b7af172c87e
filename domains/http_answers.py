"""What an OpenAI-compatible server's failure says, read the same way by every client of one
(the embedding client, the chat client): its message on one line, and how long it asks to wait."""

from __future__ import annotations

import email.utils
import json
import math
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx

MESSAGE_CHARS = 300


def server_message(response: httpx.Response, limit: int = MESSAGE_CHARS) -> str:
    """The error the server gave, on one line: OpenAI's ``error.message``, TEI's and Ollama's
    ``error``, FastAPI's ``detail`` (vLLM, infinity), else the body's text."""
    text = response.text
    found: Any = text
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            found = error["message"]
        elif error:
            found = error
        elif body.get("message"):
            found = body["message"]
        elif body.get("detail"):
            found = body["detail"]
    if not isinstance(found, str):
        found = json.dumps(found)
    line = " ".join(found.split()) or response.reason_phrase or "no message"
    return line if len(line) <= limit else line[: limit - 1] + "\u2026"


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """A ``Retry-After`` header's wait in seconds (delay-seconds or an HTTP date), None if absent
    or unreadable."""
    if value is None or not value.strip():
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:  # an HTTP date is GMT by definition
            when = when.replace(tzinfo=UTC)
        current = datetime.now(UTC).timestamp() if now is None else now
        return max(0.0, when.timestamp() - current)
    return max(0.0, seconds) if math.isfinite(seconds) else None


def retry_after(response: httpx.Response, now: Callable[[], float] = time.time) -> float | None:
    """The wait a response's ``Retry-After`` asks for, in seconds, if it says."""
    return retry_after_seconds(response.headers.get("retry-after"), now())
