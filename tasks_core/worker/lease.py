"""The lease policy (every figure derived from the lease), the attempt's own view of its lease, and
retrying database calls while it may still be valid.

Only PostgreSQL decides whether the lease is alive (every write is fenced there). The worker keeps
a local deadline — the monotonic time the last successful renewal *answered*, plus the lease — only
to know how long a database blink is worth waiting out: the database stamped the lease before it
answered, so past that deadline the lease has certainly lapsed and the attempt is over; before it a
failed call is retried with short backoff. (Counting from when the renewal was sent would give up
early whenever a claim waited for a lock.) A fenced refusal (zero rows) ends the attempt at once,
whatever the deadline says.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from tasks_core.db import is_transient
from tasks_core.settings import Settings

log = logging.getLogger(__name__)
T = TypeVar("T")

FIRST_BACKOFF = 0.05
MAX_BACKOFF = 1.0


class DatabaseUnavailable(Exception):
    """The database could not be reached (or kept failing transiently) until the deadline."""


@dataclass(frozen=True)
class LeasePolicy:
    """Every figure that follows from the lease (DTASK_LEASE_SECONDS) and its renewal interval."""

    lease_seconds: float
    # The heartbeat renews every lease/3 (Settings.heartbeat_seconds): two renewals may fail
    # before the lease lapses.
    heartbeat_seconds: float

    @classmethod
    def of(cls, settings: Settings) -> LeasePolicy:
        return cls(settings.lease_seconds, settings.heartbeat_seconds)

    @property
    def renewal_timeout_seconds(self) -> float:
        """A renewal that has not answered within one interval is retried (the next is due)."""
        return self.heartbeat_seconds

    @property
    def claim_lock_wait_seconds(self) -> float:
        """How long a claim waits for the capacity lock: well inside a heartbeat, so a claim stuck
        behind a lock never costs a running task its renewal."""
        return min(2.0, self.heartbeat_seconds)

    @property
    def stalled_after_seconds(self) -> float:
        """A worker transaction open past a lease and a heartbeat's slack belongs to a stopped
        process (the reconciler ends its session)."""
        return self.lease_seconds + self.heartbeat_seconds

    @property
    def statement_seconds(self) -> float:
        """No statement of ours may outlast a lease: an owning transaction that long has lost its
        lease anyway."""
        return self.lease_seconds

    @property
    def idle_in_transaction_seconds(self) -> float:
        """No session of ours ever needs to idle inside a transaction longer than a lease: an owning
        transaction that long has lost its lease anyway (its row lock blocks the heartbeat)."""
        return self.lease_seconds

    def clock(self, renewed_at: float | None = None) -> LeaseClock:
        """An attempt's local deadline, from the claim's (or last renewal's) answer."""
        return LeaseClock(self.lease_seconds, renewed_at=renewed_at)


class LeaseClock:
    def __init__(self, lease_seconds: float, *, renewed_at: float | None = None) -> None:
        self.lease_seconds = lease_seconds
        self.deadline = (time.monotonic() if renewed_at is None else renewed_at) + lease_seconds

    def renewed(self, answered_at: float) -> None:
        """A renewal answered at ``answered_at`` (monotonic) succeeded: the lease cannot outlive
        that plus the lease (the database stamped it before it answered)."""
        self.deadline = max(self.deadline, answered_at + self.lease_seconds)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


async def retry_transient(
    call: Callable[[], Awaitable[T]], deadline: Callable[[], float], what: str
) -> T:
    """Run ``call``; on a transient database error retry with backoff until the monotonic
    ``deadline()`` (re-read each time: a renewal may push it out). Raises DatabaseUnavailable when
    the deadline passes; any other error propagates at once."""
    delay = FIRST_BACKOFF
    failures = 0
    while True:
        try:
            result = await call()
        except Exception as exc:
            if not is_transient(exc):
                raise
            failures += 1
            left = deadline() - time.monotonic()
            if left <= 0:
                log.warning("%s: database unavailable until the lease's deadline; giving up", what)
                raise DatabaseUnavailable(f"{what}: {type(exc).__name__}") from exc
            if failures == 1:
                log.warning("%s failed (%s); retrying for up to %.1f s", what, type(exc).__name__, left)
            await asyncio.sleep(min(delay, max(left, 0.01)))
            delay = min(delay * 2, MAX_BACKOFF)
            continue
        if failures:
            log.info("%s succeeded after %d transient failure(s)", what, failures)
        return result
