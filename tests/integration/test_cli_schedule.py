"""`dtask schedule` against the real database (in-process via typer): add checks like the API,
list/show/pause/resume/rm find a schedule by name, and --owner settles a name two owners share."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from typer.testing import CliRunner

from tasks_core.ops.cli import cli
from tasks_core.schedules import ScheduleIntent, validate_schedule
from tasks_core.services import build_services
from tasks_core.store.schedules import ScheduleStore
from tests.conftest import make_settings

runner = CliRunner()


def dtask(*args: str) -> Any:
    return runner.invoke(cli, ["schedule", *args], catch_exceptions=False)


def add_for(owner: str, name: str) -> None:
    async def go() -> None:
        svc = build_services(make_settings(), pool_size=1)
        try:
            intent = ScheduleIntent(name, "diagnostics.noop", {}, every_seconds=60)
            await ScheduleStore.of(svc).create(
                validate_schedule(intent, svc.registry, svc.settings, owner, admin=True)
            )
        finally:
            await svc.close()

    asyncio.run(go())


def test_add_list_show_pause_resume_rm(clean_db: None) -> None:
    out = dtask(
        "add",
        "nightly",
        "diagnostics.noop",
        "--cron",
        "30 2 * * *",
        "--timezone",
        "Asia/Tokyo",
        "--payload",
        '{"n": 1}',
        "--priority",
        "3",
    )
    assert out.exit_code == 0, out.output
    assert out.stdout.startswith("nightly: next slot ") and out.stdout.rstrip().endswith(":30:00+00:00")
    listed = json.loads(dtask("list", "--json").stdout)["items"]
    assert [(s["owner"], s["name"], s["rule"], s["priority"]) for s in listed] == [
        ("cli", "nightly", "cron 30 2 * * * (Asia/Tokyo)", 3)
    ]
    assert "cli/nightly  diagnostics.noop  cron 30 2 * * * (Asia/Tokyo)  next " in dtask("list").stdout
    shown = json.loads(dtask("show", "nightly").stdout)
    assert len(shown["upcoming"]) == 5 and shown["last_tasks"] == [] and shown["payload"] == {"n": 1}
    assert dtask("pause", "nightly").stdout.strip() == "nightly: paused"
    assert json.loads(dtask("show", "nightly").stdout)["next_run_at"] is None
    assert dtask("resume", "nightly").stdout.startswith("nightly: active, next slot ")
    assert dtask("rm", "nightly").stdout.startswith("nightly: removed")
    assert dtask("list").stdout.strip() == "no schedules"


def test_bad_input_and_missing_schedules_exit_with_their_codes(clean_db: None) -> None:
    for args, words in (
        (("add", "x", "diagnostics.noop", "--cron", "99 * * * *"), "not a valid cron expression"),
        (("add", "x", "diagnostics.noop"), "exactly one of cron and every_seconds"),
        (("add", "x", "diagnostics.noop", "--every", "0.1"), "at least 1"),
        (
            ("add", "x", "diagnostics.noop", "--cron", "0 * * * *", "--timezone", "Moon/Base"),
            "unknown time zone",
        ),
        (("add", "x", "diagnostics.sleep", "--every", "5", "--payload", '{"seconds": "x"}'), "seconds"),
        (("add", "x", "diagnostics.noop", "--every", "5", "--payload", "{"), "--payload is not JSON"),
        (("add", "bad name", "diagnostics.noop", "--every", "5"), "letters, digits"),
    ):
        out = dtask(*args)
        assert out.exit_code == 2 and words in out.stderr, (args, out.output)
    assert dtask("list").stdout.strip() == "no schedules"
    assert dtask("add", "x", "diagnostics.noop", "--every", "5").exit_code == 0
    again = dtask("add", "x", "diagnostics.noop", "--every", "9")
    assert again.exit_code == 2 and "already exists" in again.stderr
    for verb in ("show", "pause", "resume", "rm"):
        out = dtask(verb, "nope")
        assert out.exit_code == 4 and "no schedule 'nope'" in out.stderr, (verb, out.output)


def test_a_name_two_owners_share_needs_owner(clean_db: None) -> None:
    add_for("alice", "report")
    add_for("bob", "report")
    out = dtask("pause", "report")
    assert out.exit_code == 2 and "several owners" in out.stderr and "--owner" in out.stderr
    assert dtask("pause", "report", "--owner", "bob").exit_code == 0
    states = {s["owner"]: s["paused"] for s in json.loads(dtask("list", "--json").stdout)["items"]}
    assert states == {"alice": False, "bob": True}
