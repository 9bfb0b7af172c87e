"""Transient failures of retry-safe handlers, and the backoff every retry waits.

A retry-safe type (``TaskSpec.retry_safe``) goes back to pending instead of failing when its
attempt is lost (lease, worker shutdown) or when its handler raises a transient error: a
``RetryableError``, or an exception listed in its ``TaskSpec.retry_on``. The task's slot is freed
while it waits; the next attempt is claimed like any other once its backoff has passed. After
``max_attempts`` the last error ends the task ``failed``.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from tasks_core.settings import Settings


class RetryableError(Exception):
    """Raised by a handler for a failure that another attempt may not meet (a store outage, a 429).

    ``code`` names the failure in the task's error if the attempts run out; ``delay`` (seconds)
    replaces the backoff when the cause says how long to wait (a Retry-After header).
    """

    def __init__(self, message: str, *, code: str = "retryable", delay: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.delay = delay


def jittered(base: float, attempt: int, cap: float, rng: Callable[[], float] = random.random) -> float:
    """base * 2**(attempt-1), capped, with "equal jitter" (half fixed, half random): callers that
    failed together do not all come back at the same instant and meet the recovering service as
    one burst. ``attempt`` is 1-based."""
    full = min(cap, base * 2 ** max(0, attempt - 1))
    return float(full / 2 + rng() * full / 2)


def backoff(settings: Settings, attempt: int, rng: Callable[[], float] = random.random) -> float:
    """Seconds a retry-safe task waits after its failed attempt ``attempt`` (1-based)."""
    return jittered(settings.retry_backoff_seconds, attempt, settings.retry_backoff_max_seconds, rng)


def longest_wait(settings: Settings, max_attempts: int) -> float:
    """The most a task can spend waiting between its attempts (jitter at its maximum)."""
    return float(
        sum(
            min(settings.retry_backoff_max_seconds, settings.retry_backoff_seconds * 2 ** (n - 1))
            for n in range(1, max_attempts)
        )
    )
