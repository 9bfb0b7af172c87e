"""When a schedule fires: a cron expression in an IANA time zone, or a fixed interval.

Cron is read by cronsim (Debian cron's rules), in the schedule's zone, and every instant is
stored in UTC. Daylight saving time, for an expression naming a fixed minute and hour
(``30 2 * * *``): a local time the clocks skip (02:30 on the spring-forward night) fires at the
first minute after the jump (03:00 local), once; a local time that happens twice (the fall-back
night) fires once, at its first occurrence. Expressions with a wildcard minute or hour
(``*/15 * * * *``) keep their pace in real time: the skipped hour has no slots, and the repeated
hour fires in both of its passes.

An interval's slots are ``next_run_at + k * every_seconds``: the grid starts one interval after
the schedule's creation and stays put (a pass that runs late fires the slot it missed, and the
next one is back on the grid).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from tasks_core.schedule_model import MIN_EVERY_SECONDS

# An interval past this is a mistake in units (and overflows PostgreSQL's intervals long after).
MAX_EVERY_SECONDS = 10 * 366 * 86400.0
ONE_SECOND = timedelta(seconds=1)


class BadRule(ValueError):
    """A refused cron expression, zone or interval; ``field`` names the input at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Rule:
    cron: str | None = None
    every_seconds: float | None = None
    timezone: str = "UTC"

    @classmethod
    def checked(cls, cron: object, every_seconds: object, timezone: object) -> Rule:
        """The rule, or BadRule saying what is wrong with it."""
        if (cron is None) == (every_seconds is None):
            raise BadRule("cron", "give exactly one of cron and every_seconds")
        if every_seconds is not None:
            if timezone is not None:
                raise BadRule(
                    "timezone", "applies to cron schedules only (an interval is the same in every zone)"
                )
            number = isinstance(every_seconds, int | float) and not isinstance(every_seconds, bool)
            try:
                every = float(every_seconds) if number else math.nan  # type: ignore[arg-type]
            except OverflowError:  # an int beyond any float
                every = math.inf
            if not math.isfinite(every) or every < MIN_EVERY_SECONDS:
                raise BadRule(
                    "every_seconds", f"must be a finite number of seconds, at least {MIN_EVERY_SECONDS:g}"
                )
            if every > MAX_EVERY_SECONDS:
                raise BadRule("every_seconds", f"must be at most {MAX_EVERY_SECONDS:g} s (10 years)")
            return cls(every_seconds=every)
        zone = "UTC" if timezone is None else timezone
        if not isinstance(zone, str) or not zone or len(zone) > 100:
            raise BadRule("timezone", "must be an IANA time zone name, e.g. Europe/Paris")
        try:
            ZoneInfo(zone)
        except (ZoneInfoNotFoundError, ValueError, OSError):
            raise BadRule(
                "timezone", f"unknown time zone {zone[:100]!r} (an IANA name, e.g. Europe/Paris)"
            ) from None
        if not isinstance(cron, str) or len(cron.split()) != 5 or len(cron) > 200:
            raise BadRule("cron", "must be five fields: minute hour day-of-month month day-of-week")
        rule = cls(cron=" ".join(cron.split()), timezone=zone)
        try:
            rule.next_after(datetime.now(UTC))
        except (CronSimError, StopIteration) as exc:
            raise BadRule("cron", f"not a valid cron expression: {exc or 'it never fires'}") from None
        return rule

    @classmethod
    def of_row(cls, row: Mapping[str, Any]) -> Rule:
        """The rule of a stored schedule row."""
        return cls(cron=row["cron"], every_seconds=row["every_seconds"], timezone=row["timezone"])

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    def describe(self) -> str:
        if self.cron is not None:
            return f"cron {self.cron} ({self.timezone})"
        return f"every {self.every_seconds:g} s"

    def next_after(self, instant: datetime) -> datetime:
        """The first slot strictly after ``instant`` (an interval's grid is anchored by the caller:
        see ``first`` and ``plan``)."""
        if self.cron is None:
            assert self.every_seconds is not None
            return instant + timedelta(seconds=self.every_seconds)
        local = instant.astimezone(self.zone)
        return next(CronSim(self.cron, local)).astimezone(UTC)

    def first(self, now: datetime) -> datetime:
        """The first slot of a new schedule created at ``now``."""
        return self.next_after(now)

    def plan(self, next_run_at: datetime, now: datetime) -> tuple[datetime, datetime]:
        """For a due schedule (``next_run_at <= now``): the slot to fire now, the latest one due
        (slots missed while nothing ran collapse into it: one catch-up task, not a burst), and
        the next slot after ``now``."""
        if self.cron is None:
            assert self.every_seconds is not None
            step = timedelta(seconds=self.every_seconds)
            missed = max(0, math.floor((now - next_run_at) / step))
            slot = next_run_at + missed * step
            while slot + step <= now:  # float rounding of the division
                slot += step
            return slot, slot + step
        # The latest cron instant at or before now: iterate backwards from just after now's second.
        start = now.astimezone(self.zone).replace(microsecond=0) + ONE_SECOND
        try:
            latest = next(CronSim(self.cron, start, reverse=True)).astimezone(UTC)
        except StopIteration:  # nothing in the 50 years cronsim looks back: the stored slot stands
            latest = next_run_at
        return max(next_run_at, latest), self.next_after(now)

    def resumed(self, next_run_at: datetime, now: datetime) -> datetime:
        """The next slot after ``now`` for a schedule resumed at ``now``: nothing missed while it
        was paused fires. An interval stays on its grid."""
        if next_run_at > now:
            return next_run_at
        if self.cron is None:
            return self.plan(next_run_at, now)[1]
        return self.next_after(now)

    def upcoming(self, next_run_at: datetime, count: int) -> list[datetime]:
        """``next_run_at`` and the slots after it."""
        out = [next_run_at]
        while len(out) < count:
            out.append(self.next_after(out[-1]))
        return out
