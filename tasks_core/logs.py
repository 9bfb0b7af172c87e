"""Log hygiene for processes that read untrusted input (broker messages, request bodies).

Anyone who can write to the broker can make Celery (or us) log a message's headers and body; a
forged 20 MB task id must cost a line, not 20 MB of log. ``install`` puts a truncating filter on
every handler of the root logger, so it covers Celery's own records as well as ours.
"""

from __future__ import annotations

import logging

MAX_RECORD_CHARS = 4000


class Truncate(logging.Filter):
    def __init__(self, limit: int = MAX_RECORD_CHARS) -> None:
        super().__init__()
        self.limit = limit

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if len(message) > self.limit:
            record.msg = f"{message[: self.limit]}… [{len(message) - self.limit} more characters]"
            record.args = None
        if record.exc_info and not record.exc_text:
            text = logging.Formatter().formatException(record.exc_info)
            if len(text) > self.limit:
                record.exc_text = f"{text[: self.limit]}… [{len(text) - self.limit} more characters]"
        return True


def install(logger: logging.Logger | None = None, limit: int = MAX_RECORD_CHARS) -> None:
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, Truncate) for f in handler.filters):
            handler.addFilter(Truncate(limit))


def short(value: object, limit: int = 200) -> str:
    """A value from an untrusted message, for a log line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"
