"""`dtask schedule add|list|show|rm|pause|resume`: durable schedules from the command line.

Schedules added here belong to the owner `cli` (as `dtask submit`'s tasks do). The other commands
act as an operator: they find a schedule by name among every owner's, and need ``--owner`` only
when two owners use the same name. Exit codes: 2 for invalid input, 4 for no such schedule.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, NoReturn

import typer

from tasks_core.ops.cli_errors import Exit

schedule_app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    help="Durable schedules: a task created at each cron or interval slot, once per slot.",
)
CLI_OWNER = "cli"
OwnerOption = Annotated[str | None, typer.Option(help="whose schedule, when two owners share the name")]


def _fail(message: str, code: int) -> NoReturn:
    typer.echo(message, err=True)
    raise typer.Exit(int(code))


def _iso(value: Any) -> str:
    return "" if value is None else value.isoformat()


def _view(row: dict[str, Any]) -> dict[str, Any]:
    rule = f"cron {row['cron']} ({row['timezone']})" if row["cron"] else f"every {row['every_seconds']:g} s"
    return {
        "name": row["name"],
        "owner": row["owner"],
        "task_type": row["task_type"],
        "rule": rule,
        "payload": row["payload"],
        "priority": row["priority"],
        "paused": row["paused_at"] is not None,
        "next_run_at": None if row["paused_at"] else _iso(row["next_run_at"]),
        "last_fired_at": _iso(row["last_fired_at"]) or None,
        "last_error": row["last_error"],
    }


async def _one(services: Any, name: str, owner: str | None) -> dict[str, Any]:
    from tasks_core.schedules import NAME
    from tasks_core.store.schedules import ScheduleStore

    rows = await ScheduleStore.of(services).find(name, owner) if NAME.fullmatch(name) else []
    if not rows:
        _fail(f"no schedule {name!r}" + (f" of {owner!r}" if owner else ""), Exit.NO_TASK)
    if len(rows) > 1:
        owners = ", ".join(r["owner"] for r in rows[:10])
        _fail(f"several owners have a schedule named {name!r} ({owners}): pass --owner", Exit.USAGE)
    return rows[0]


@schedule_app.command("add")
def add(
    name: str,
    task_type: str,
    payload: Annotated[str, typer.Option(help="JSON object")] = "{}",
    cron: Annotated[str | None, typer.Option(help="five fields, e.g. '30 2 * * *'")] = None,
    every: Annotated[float | None, typer.Option("--every", help="a fixed interval, in seconds")] = None,
    timezone: Annotated[
        str | None, typer.Option(help="IANA zone of the cron expression (default UTC)")
    ] = None,
    priority: Annotated[int, typer.Option(help="its tasks' priority (-100..100)")] = 0,
) -> None:
    """Add a schedule (owner `cli`); prints its next slot."""
    from tasks_core.ops.cli import client_services, run_command
    from tasks_core.schedules import ScheduleIntent, validate_schedule
    from tasks_core.store.schedules import ScheduleStore
    from tasks_core.submission import InvalidTask

    try:
        body = json.loads(payload)
    except json.JSONDecodeError as exc:
        _fail(f"--payload is not JSON: {exc}", Exit.USAGE)
    intent = ScheduleIntent(name, task_type, body, cron, every, timezone, priority)

    async def go() -> dict[str, Any] | None:
        async with client_services() as services:
            new = validate_schedule(intent, services.registry, services.settings, CLI_OWNER, admin=True)
            return await ScheduleStore.of(services).create(new)

    try:
        row = run_command(go)
    except InvalidTask as exc:
        _fail(f"invalid schedule: {exc}", Exit.USAGE)
    if row is None:
        _fail(f"a schedule named {name!r} already exists (owner {CLI_OWNER})", Exit.USAGE)
    typer.echo(f"{row['name']}: next slot {_iso(row['next_run_at'])}")


@schedule_app.command("list")
def list_schedules(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Every owner's schedules, by owner and name."""
    from tasks_core.ops.cli import client_services, run_command
    from tasks_core.store.schedules import ScheduleStore

    async def go() -> list[dict[str, Any]]:
        async with client_services() as services:
            return await ScheduleStore.of(services).listed(None)

    views = [_view(r) for r in run_command(go)]
    if as_json:
        typer.echo(json.dumps({"items": views}))
        return
    if not views:
        typer.echo("no schedules")
        return
    for v in views:
        state = "paused" if v["paused"] else f"next {v['next_run_at']}"
        typer.echo(f"{v['owner']}/{v['name']}  {v['task_type']}  {v['rule']}  {state}")


@schedule_app.command("show")
def show(name: str, owner: OwnerOption = None) -> None:
    """One schedule, its next slots and its last tasks (JSON)."""
    from tasks_core.ops.cli import client_services, run_command
    from tasks_core.schedule_rules import Rule
    from tasks_core.store.schedules import ScheduleStore

    async def go() -> dict[str, Any]:
        async with client_services() as services:
            row = await _one(services, name, owner)
            runs = await ScheduleStore.of(services).runs(row["id"])
            upcoming = [] if row["paused_at"] else Rule.of_row(row).upcoming(row["next_run_at"], 5)
            return {
                **_view(row),
                "upcoming": [_iso(u) for u in upcoming],
                "last_tasks": [
                    {"task_id": str(r["task_id"]), "slot_at": _iso(r["slot_at"]), "status": r["status"]}
                    for r in runs
                ],
            }

    typer.echo(json.dumps(run_command(go), indent=2))


def _act(name: str, owner: str | None, action: str) -> None:
    from tasks_core.ops.cli import client_services, run_command
    from tasks_core.store.schedules import ScheduleStore

    async def go() -> dict[str, Any] | None:
        async with client_services() as services:
            row = await _one(services, name, owner)
            store = ScheduleStore.of(services)
            if action == "rm":
                await store.delete(row["id"])
                return None
            return await (store.pause if action == "pause" else store.resume)(row["id"])

    row = run_command(go)
    if row is None:
        typer.echo(f"{name}: removed (the tasks it created stay)")
    elif row["paused_at"] is not None:
        typer.echo(f"{name}: paused")
    else:
        typer.echo(f"{name}: active, next slot {_iso(row['next_run_at'])}")


@schedule_app.command("rm")
def rm(name: str, owner: OwnerOption = None) -> None:
    """Remove a schedule (the tasks it created stay)."""
    _act(name, owner, "rm")


@schedule_app.command("pause")
def pause(name: str, owner: OwnerOption = None) -> None:
    """Pause a schedule: no slot fires until it is resumed."""
    _act(name, owner, "pause")


@schedule_app.command("resume")
def resume(name: str, owner: OwnerOption = None) -> None:
    """Resume a schedule from now on (slots missed while paused do not fire)."""
    _act(name, owner, "resume")
