"""When schedules fire: cron in a time zone across DST changes, intervals on a fixed grid, the one
catch-up slot after downtime, resume without a burst, and the refusals of bad rules."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tasks_core.schedule_rules import BadRule, Rule
from tasks_core.settings import Settings

NY = "America/New_York"  # 2026: clocks jump 02:00 -> 03:00 on 8 March, fall back 02:00 -> 01:00 on 1 November


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


def local(instants: list[datetime], zone: str = NY) -> list[str]:
    rule = Rule(cron="* * * * *", timezone=zone)
    return [i.astimezone(rule.zone).isoformat() for i in instants]


def test_a_cron_time_the_clocks_skip_fires_once_right_after_the_jump() -> None:
    rule = Rule.checked("30 2 * * *", None, NY)
    first = rule.next_after(utc(2026, 3, 7, 12))
    assert local(rule.upcoming(first, 3)) == [
        "2026-03-08T03:00:00-04:00",  # 02:30 does not exist that night
        "2026-03-09T02:30:00-04:00",
        "2026-03-10T02:30:00-04:00",
    ]


def test_a_cron_time_that_happens_twice_fires_once_at_its_first_occurrence() -> None:
    rule = Rule.checked("30 1 * * *", None, NY)
    first = rule.next_after(utc(2026, 10, 31, 12))
    assert rule.upcoming(first, 2) == [
        utc(2026, 11, 1, 5, 30),
        utc(2026, 11, 2, 6, 30),
    ]  # 01:30 EDT, then EST


def test_a_wildcard_hour_keeps_its_pace_through_both_changes() -> None:
    rule = Rule.checked("*/30 * * * *", None, NY)
    # Fall back: the repeated hour 01:00-02:00 fires in both passes, every 30 real minutes.
    fall = rule.upcoming(rule.next_after(utc(2026, 11, 1, 4, 50)), 6)
    assert fall == [utc(2026, 11, 1, 5) + timedelta(minutes=30 * k) for k in range(6)]
    # Spring forward: 01:30 EST is followed by 03:00 EDT, thirty minutes later.
    spring = rule.upcoming(rule.next_after(utc(2026, 3, 8, 6, 20)), 3)
    assert local(spring) == [
        "2026-03-08T01:30:00-05:00",
        "2026-03-08T03:00:00-04:00",
        "2026-03-08T03:30:00-04:00",
    ]


def test_cron_reads_the_expression_in_its_zone_and_stores_utc() -> None:
    paris = Rule.checked("0 9 * * 1-5", None, "Europe/Paris")
    nxt = paris.next_after(utc(2026, 12, 4, 9))  # a Friday, 10:00 in Paris
    assert nxt == utc(2026, 12, 7, 8) and nxt.tzinfo is UTC  # Monday 09:00 CET
    assert Rule.checked("0 9 * * *", None, None).timezone == "UTC"


def test_downtime_fires_one_catch_up_slot_the_latest_missed() -> None:
    daily = Rule.checked("0 3 * * *", None, None)
    slot, nxt = daily.plan(utc(2026, 12, 1, 3), utc(2026, 12, 5, 12))  # four days down
    assert (slot, nxt) == (utc(2026, 12, 5, 3), utc(2026, 12, 6, 3))
    every = Rule.checked(None, 10, None)
    slot, nxt = every.plan(utc(2026, 12, 1), utc(2026, 12, 1, 0, 1, 35))  # nine slots missed
    assert (slot, nxt) == (utc(2026, 12, 1, 0, 1, 30), utc(2026, 12, 1, 0, 1, 40))  # still on the grid


def test_a_slot_due_exactly_now_fires_now() -> None:
    every = Rule.checked(None, 2.5, None)
    assert every.plan(utc(2026, 12, 1), utc(2026, 12, 1)) == (
        utc(2026, 12, 1),
        utc(2026, 12, 1, 0, 0, 2, 500000),
    )
    hourly = Rule.checked("0 * * * *", None, None)
    assert hourly.plan(utc(2026, 12, 1, 5), utc(2026, 12, 1, 5)) == (utc(2026, 12, 1, 5), utc(2026, 12, 1, 6))


def test_resume_starts_after_now_and_fires_nothing_missed() -> None:
    every = Rule.checked(None, 60, None)
    assert every.resumed(utc(2026, 12, 1), utc(2026, 12, 1, 5, 0, 30)) == utc(2026, 12, 1, 5, 1)
    hourly = Rule.checked("0 * * * *", None, None)
    assert hourly.resumed(utc(2026, 12, 1), utc(2026, 12, 3, 7, 10)) == utc(2026, 12, 3, 8)
    assert hourly.resumed(utc(2026, 12, 9), utc(2026, 12, 3)) == utc(2026, 12, 9)  # not yet due: kept


@pytest.mark.parametrize(
    ("cron", "every", "zone", "field", "words"),
    [
        (None, None, None, "cron", "exactly one of cron and every_seconds"),
        ("* * * * *", 60, None, "cron", "exactly one of cron and every_seconds"),
        ("61 * * * *", None, None, "cron", "not a valid cron expression"),
        ("0 0 30 2 *", None, None, "cron", "not a valid cron expression"),
        ("* * * *", None, None, "cron", "five fields"),
        ("0 0 * * * *", None, None, "cron", "five fields"),
        (42, None, None, "cron", "five fields"),
        ("* * * * *", None, "Mars/Olympus_Mons", "timezone", "unknown time zone"),
        ("* * * * *", None, "../../etc/passwd", "timezone", "unknown time zone"),
        ("* * * * *", None, "", "timezone", "IANA time zone"),
        ("* * * * *", None, "Europe/" + "x" * 300, "timezone", "IANA time zone"),
        (None, 0.5, None, "every_seconds", "at least 1"),
        (None, -3, None, "every_seconds", "at least 1"),
        (None, float("inf"), None, "every_seconds", "finite"),
        (None, float("nan"), None, "every_seconds", "finite"),
        (None, True, None, "every_seconds", "finite"),
        (None, "60", None, "every_seconds", "finite"),
        (None, 1e12, None, "every_seconds", "at most"),
        (None, 60, "UTC", "timezone", "cron schedules only"),
    ],
)
def test_bad_rules_are_refused_naming_the_field(
    cron: object, every: object, zone: object, field: str, words: str
) -> None:
    with pytest.raises(BadRule) as refused:
        Rule.checked(cron, every, zone)
    assert refused.value.field == field and words in refused.value.message, refused.value


def test_the_scheduler_runs_on_beat_every_schedule_seconds_else_the_publish_interval() -> None:
    from tasks_core.celery_config import beat_schedule, celery_settings

    entry = beat_schedule(Settings(publish_seconds=7.0))["fire-schedules"]
    assert entry["task"] == "dtask.schedule" and entry["schedule"] == entry["options"]["expires"] == 7.0
    assert entry["options"]["queue"] == "duties"
    assert beat_schedule(Settings(schedule_seconds=1.5))["fire-schedules"]["schedule"] == 1.5
    assert celery_settings(Settings())["task_routes"]["dtask.schedule"] == {"queue": "duties"}
    with pytest.raises(ValueError, match="schedule_seconds"):
        Settings(schedule_seconds=0)
