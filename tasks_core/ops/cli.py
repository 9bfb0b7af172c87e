"""`dtask`: one entry point for operators and users."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any, NoReturn, TypeVar

import typer

from tasks_core.model import Status
from tasks_core.ops import cli_format
from tasks_core.ops.cli_errors import EXIT_HELP, Exit, classify
from tasks_core.settings import Settings, get_settings

T = TypeVar("T")
# The oldest finished task worth naming: older ages overflow PostgreSQL's timestamps.
MAX_PRUNE_DAYS = 36500


def _exit_codes_epilog() -> str:
    rows = "\n".join(f"  {int(code):>3}  {text}" for code, text in EXIT_HELP.items())
    # "\b" keeps click from re-wrapping the table.
    return f"\b\nExit codes:\n{rows}"


cli = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="durable-tasks: durable background tasks.",
    epilog=_exit_codes_epilog(),
    rich_markup_mode=None,
)


def run_command(fn: Callable[[], Awaitable[T]]) -> T:
    """Run a command's coroutine; a database problem ends the command with one line and its code."""
    try:
        return asyncio.run(fn())  # type: ignore[arg-type]
    except Exception as exc:
        problem = classify(exc, get_settings().database_url or "")
        if problem is None:
            raise
        _fail(str(problem), problem.code)


def _fail(message: str, code: int = Exit.FAILED) -> NoReturn:
    typer.echo(message, err=True)
    raise typer.Exit(int(code))


def _services(settings: Settings | None = None) -> Any:
    from tasks_core.services import build_services

    return build_services(settings or get_settings(), pool_size=2)


@asynccontextmanager
async def client_services() -> AsyncIterator[Any]:
    """Services for one client command, once the database is known to carry this release's schema."""
    from tasks_core.db import check_schema

    # The command reports every outcome itself (a failed publish included): library warnings on top
    # would say the same thing twice.
    logging.basicConfig(level=logging.ERROR)
    services = _services()
    try:
        await check_schema(services.engine)
        yield services
    finally:
        await services.close()


def _schema_gate(settings: Settings) -> None:
    from tasks_core.db import SchemaNotCurrent, check_schema_blocking

    try:
        check_schema_blocking(settings.require_database())
    except SchemaNotCurrent as exc:
        _fail(f"refusing to start: {exc}", Exit.USAGE)


def _task_id(raw: str) -> uuid.UUID:
    try:
        return uuid.UUID(raw)
    except ValueError:
        _fail(f"not a task id: {raw!r}", Exit.USAGE)


@cli.command()
def migrate() -> None:
    """Bring the database schema to this release (the only command that changes it).

    Accepts an empty database, the pre-durable release's (upgraded in place) or an older schema of
    this project; refuses anything else before changing it. One transaction under an advisory lock.
    """
    from tasks_core.ops.schema_upgrade import MigrationRefused, upgrade_database

    settings = get_settings()
    url = settings.require_database()
    try:
        outcome = asyncio.run(upgrade_database(url, timeout_seconds=settings.default_timeout_seconds))
    except MigrationRefused as exc:
        _fail(f"refusing to migrate (nothing was changed): {exc}", Exit.SCHEMA)
    except Exception as exc:
        problem = classify(exc, url)
        if problem is None:
            _fail(f"migration failed (nothing was changed): {exc}")
        _fail(str(problem), problem.code)
    typer.echo(f"found: {outcome.found.describe()}")
    if outcome.counts:
        typer.echo("carried over: " + ", ".join(f"{n} {what}" for what, n in outcome.counts.items()))
    typer.echo("schema is current")


@cli.command("db-status")
def db_status() -> None:
    """Show the database's starting point, its schema revision and the one this release needs, and
    the pre-durable tasks the reconciler has yet to converge."""
    from tasks_core.db import make_engine
    from tasks_core.ops.schema_detect import Detection
    from tasks_core.ops.schema_detect import classify as starting_point
    from tasks_core.store.facade import TaskStore

    async def go() -> tuple[Detection, dict[str, int] | None]:
        engine = make_engine(get_settings().require_database(), pool_size=1)
        try:
            async with engine.connect() as conn:
                found = await conn.run_sync(starting_point)
            backlog = await TaskStore(engine).legacy_backlog() if found.kind == "current" else None
            return found, backlog
        finally:
            await engine.dispose()

    found, backlog = run_command(go)
    typer.echo(f"starting point: {found.describe()}")
    typer.echo(f"database: {found.revision or 'no version'}\nrelease:  {found.head}")
    if backlog is not None:
        detail = ", ".join(f"{n} {status}" for status, n in sorted(backlog.items()))
        typer.echo(f"legacy tasks to converge: {sum(backlog.values())}" + (f" ({detail})" if detail else ""))
    if found.kind == "refused":
        _fail("`dtask migrate` refuses this database", Exit.SCHEMA)
    if found.kind != "current":
        _fail("schema is not current: run `dtask migrate`", Exit.SCHEMA)


@cli.command()
def worker(
    concurrency: Annotated[
        int | None, typer.Option("--concurrency", "-c", help="tasks at once: pool processes, or threads")
    ] = None,
    pool: Annotated[
        str,
        typer.Option(
            help="prefork (a process per task: CPU-heavy handlers), threads (the dense mode: many "
            "I/O-bound tasks in one process, on one event loop) or solo"
        ),
    ] = "prefork",
    queues: Annotated[
        str | None,
        typer.Option(
            "--queues", "-Q", help="task queues to consume, comma-separated (default: durable); duties always"
        ),
    ] = None,
    loglevel: Annotated[str, typer.Option("--loglevel", "-l")] = "INFO",
    hostname: Annotated[str | None, typer.Option("--hostname", "-n")] = None,
) -> None:
    """Run a worker: durable tasks and the duties that recover them."""
    if pool not in WORKER_POOLS:
        _fail(f"--pool {pool!r} is not supported: use {', '.join(WORKER_POOLS)}", Exit.USAGE)
    settings = get_settings()
    settings.require_broker()
    _schema_gate(settings)
    from tasks_core.celery_app import app
    from tasks_core.ops.commands import worker_args
    from tasks_core.transport import DURABLE_QUEUE, DUTIES_QUEUE

    consumed = [q.strip() for q in (queues or DURABLE_QUEUE).split(",") if q.strip()]
    argv = worker_args(
        queues=list(dict.fromkeys([*consumed, DUTIES_QUEUE])),  # every worker runs the duties
        concurrency=concurrency or settings.concurrency,
        pool=pool,
        loglevel=loglevel,
        # A node name of its own per process: two workers on one host must not share one (on
        # RabbitMQ the node's pidbox queue is exclusive, and the second would fail to start).
        node=hostname or f"dtask-{os.getpid()}@%h",
        events=True,
    )
    app.worker_main(argv)


# prefork, the dense mode (threads), and solo; Celery's other pools are refused.
WORKER_POOLS = ("prefork", "threads", "solo")


@cli.command()
def beat(
    schedule: Annotated[str, typer.Option(help="beat's schedule file")] = "celerybeat-schedule",
    loglevel: Annotated[str, typer.Option("--loglevel", "-l")] = "INFO",
) -> None:
    """Run the scheduler of the publisher and reconciler (run exactly one)."""
    settings = get_settings()
    settings.require_broker()
    _schema_gate(settings)
    from tasks_core.celery_app import app
    from tasks_core.ops.commands import beat_args

    app.start(beat_args(schedule=schedule, loglevel=loglevel))


@cli.command()
def api(
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8000,
    workers: Annotated[int, typer.Option(help="uvicorn worker processes")] = 1,
) -> None:
    """Serve the HTTP API (OpenAPI at /docs)."""
    import uvicorn

    settings = get_settings()
    settings.require_broker()  # the api publishes task ids; it never guesses a broker
    _schema_gate(settings)
    if not settings.api_keys:
        typer.echo("warning: DTASK_API_KEYS is empty; every request except health will get 401", err=True)
    uvicorn.run(
        "app.main:create_app",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        # By name, like the app: tasks_core does not import app. It adds the deadlines for slow
        # clients that uvicorn lacks (the body the app reads has its own, in the app).
        http="app.server:DeadlineProtocol",
        limit_concurrency=settings.api_limit_concurrency,
    )


@cli.command()
def flower(
    address: Annotated[
        str,
        typer.Option(
            help="interface; without DTASK_FLOWER_BASIC_AUTH Flower refuses to start, on loopback too, "
            "unless --insecure-local"
        ),
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 5555,
    insecure_local: Annotated[
        bool,
        typer.Option(
            "--insecure-local",
            help="development only: allow no DTASK_FLOWER_BASIC_AUTH on 127.0.0.1/localhost",
        ),
    ] = False,
) -> None:
    """Run Flower, Celery's dashboard, behind DTASK_FLOWER_BASIC_AUTH, on the workers' broker."""
    from tasks_core.ops.flower import flower_command

    flower_command(address, port, insecure_local)


# How long `dtask submit` rides out a database blink (retrying under one Idempotency-Key).
SUBMIT_RETRY_SECONDS = 10.0


@cli.command()
def submit(
    task_type: str,
    payload: Annotated[str, typer.Option(help="JSON object")] = "{}",
    dedupe_key: Annotated[str | None, typer.Option()] = None,
    timeout: Annotated[float | None, typer.Option(help="seconds")] = None,
    run_at: Annotated[
        str | None, typer.Option("--run-at", help="not before this instant (RFC 3339 with a zone)")
    ] = None,
    delay: Annotated[float | None, typer.Option("--delay", help="not before this many seconds from now")] = (
        None
    ),
    priority: Annotated[int, typer.Option(help="higher runs first among runnable tasks (-100..100)")] = 0,
    wait: Annotated[bool, typer.Option("--wait", help="show progress until the task ends")] = False,
    idempotency_key: Annotated[
        str | None,
        typer.Option(help="makes a repeated submit return the first one's task (kept 24 h); default: fresh"),
    ] = None,
) -> None:
    """Submit a task and print its id.

    A database blink is ridden out: the submission is retried for a few seconds under one
    Idempotency-Key, so a retry after a lost answer never stores the task twice."""
    from tasks_core import metrics
    from tasks_core.submission import Idempotency, InvalidTask, Submitter, TaskIntent
    from tasks_core.worker.lease import retry_transient

    # Before anything is stored: a task nobody can send would wait for a broker that does not exist.
    get_settings().require_broker()
    try:
        body = json.loads(payload)
    except json.JSONDecodeError as exc:
        _fail(f"--payload is not JSON: {exc}", Exit.USAGE)

    intent = TaskIntent(
        task_type, body, dedupe_key=dedupe_key, timeout_seconds=timeout, run_at=run_at, delay_seconds=delay,
        priority=priority,
    )
    key = idempotency_key or str(uuid.uuid4())
    request = json.dumps([task_type, body, dedupe_key, timeout, run_at, delay, priority], sort_keys=True)
    idempotency = Idempotency(key, hashlib.sha256(request.encode()).hexdigest())

    async def go() -> Any:
        async with client_services() as services:
            deadline = time.monotonic() + SUBMIT_RETRY_SECONDS
            result = await retry_transient(
                lambda: Submitter(services).submit(
                    intent, owner="cli", idempotency=idempotency, public=True
                ),
                lambda: deadline,
                "submission",
            )
            with contextlib.suppress(Exception):  # the counters wait for the next flush
                await metrics.flush(services.redis)
            return result

    try:
        result = run_command(go)
    except InvalidTask as exc:
        _fail(f"invalid task: {exc}", Exit.USAGE)
    if result.duplicate_of is not None:
        typer.echo(f"an active task already holds this dedupe key: {result.duplicate_of}", err=True)
    elif result.publish_error:
        warning = f"warning: not published yet ({result.publish_error}); the publisher will send it"
        typer.echo(warning, err=True)
    elif not result.published and not result.replayed:
        typer.echo("waiting for a free slot: it is sent as soon as capacity frees", err=True)
    if wait:
        _watch(result.task_id)
    typer.echo(str(result.task_id))


def _watch(task_id: uuid.UUID) -> NoReturn:
    try:
        # The id is printed inside the guard: a Ctrl-C right after it still gets the sentence below.
        typer.echo(str(task_id))
        code = _wait(task_id)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the sentence
        _fail(
            f"stopped watching; task {task_id} goes on. Watch it with `dtask show {task_id}`, "
            f"cancel it with `dtask cancel {task_id}`",
            Exit.INTERRUPTED,
        )
    sys.exit(code)


def _wait(task_id: uuid.UUID) -> int:
    """Show the task's progress until it ends; KeyboardInterrupt on Ctrl-C.

    Ctrl-C only sets a flag the polling loop reads at its next turn: raised wherever the signal
    happened to land (inside the event loop's construction, say), it ended the command with a
    traceback about a half-made loop instead of the sentence that the task goes on."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    interrupted = threading.Event()

    async def go() -> dict[str, Any] | None:
        async with client_services() as services:
            with Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.percentage:>3.0f}%"),
                TimeElapsedColumn(),
                transient=False,
            ) as bar:
                handle = bar.add_task("pending", total=100)
                while not interrupted.is_set():
                    row = await services.repo.get(task_id)
                    if row is None:
                        raise RuntimeError("task disappeared")
                    label = f"{row['status']}: {row['message'] or ''}"[:60]
                    bar.update(handle, completed=row["progress"], description=label)
                    if row["status"] in ("success", "failed", "cancelled"):
                        return dict(row)
                    await asyncio.sleep(0.5)
        return None

    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    try:
        row = run_command(go)
    finally:
        signal.signal(signal.SIGINT, previous)
    if row is None:
        raise KeyboardInterrupt
    if row["error"]:
        typer.echo(f"{row['status']}: {row['error']['code']}: {row['error']['message']}", err=True)
    return 0 if row["status"] == "success" else int(Exit.FAILED)


@cli.command()
def show(task_id: str, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Show one task (`--json`: exactly the HTTP task object)."""
    from tasks_core.views import task_view

    tid = _task_id(task_id)

    async def go() -> dict[str, Any] | None:
        async with client_services() as services:
            row = await services.repo.get(tid)
            if row is None:
                return None
            return task_view(row, await services.repo.waiting_reason(row, services.settings.capacity))

    view = run_command(go)
    if view is None:
        _fail(f"no task {task_id}", Exit.NO_TASK)
    if as_json:
        typer.echo(json.dumps(view))
        return
    typer.echo("\n".join(cli_format.show_lines(view)))


@cli.command("list")
def list_tasks(
    status: Annotated[Status | None, typer.Option(help="only tasks in this state")] = None,
    task_type: Annotated[str | None, typer.Option("--type", help="only tasks of this type")] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 50,
    cursor: Annotated[str | None, typer.Option()] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """List tasks, newest first (keyset pages: pass --cursor to continue)."""
    from tasks_core.views import task_view

    async def go() -> tuple[list[dict[str, Any]], str | None]:
        async with client_services() as services:
            rows, nxt = await services.repo.list(
                status=status.value if status else None, task_type=task_type, limit=limit, cursor=cursor
            )
            return [task_view(r) for r in rows], nxt

    try:
        items, nxt = run_command(go)
    except ValueError as exc:
        _fail(str(exc), Exit.USAGE)
    if as_json:
        typer.echo(json.dumps({"items": items, "next_cursor": nxt}))
        return
    if not items:
        typer.echo("no tasks")
        return
    typer.echo(cli_format.LIST_HEADER)
    for view in items:
        typer.echo(cli_format.list_row(view))
    if nxt:
        typer.echo(f"next page: --cursor {nxt}")


@cli.command()
def cancel(task_id: str) -> None:
    """Cancel a task: pending at once, running by intent (it stops at its next heartbeat)."""
    tid = _task_id(task_id)

    async def go() -> str | None:
        async with client_services() as services:
            outcome: str | None = await services.repo.request_cancel(tid, services.registry)
            return outcome

    outcome = run_command(go)
    if outcome is None:
        _fail(f"no task {task_id}", Exit.NO_TASK)
    if outcome == "terminal":
        _fail("task already finished", Exit.FINISHED)
    typer.echo("cancelled" if outcome == "cancelled" else "cancel requested")


@cli.command()
def retry(task_ids: Annotated[list[str], typer.Argument(help="failed or cancelled tasks")]) -> None:
    """Submit failed or cancelled tasks again, each as a new task (one transaction); prints
    `old new` per task. A task is retried once: again names its retry and exits 1."""
    from tasks_core.retries import Retried, RetryRefused, retry_tasks
    from tasks_core.submission import InvalidTask, Submitter

    ids = [_task_id(raw) for raw in task_ids]

    async def go() -> list[Retried | InvalidTask]:
        async with client_services() as services:  # an operator's command: any owner's task
            try:
                return await retry_tasks(Submitter(services), ids, owner=None, admin=True)
            except InvalidTask as exc:
                _fail(f"invalid: {exc}", Exit.USAGE)

    code = 0
    for task_id, outcome in zip(ids, run_command(go), strict=True):
        if isinstance(outcome, Retried):
            typer.echo(f"{task_id} {outcome.new.task_id}")
            continue
        also = f" ({outcome.task_id})" if isinstance(outcome, RetryRefused) and outcome.task_id else ""
        typer.echo(f"{task_id}: {outcome.message}{also}", err=True)
        missing = isinstance(outcome, RetryRefused) and outcome.status == 404
        code = max(code, Exit.NO_TASK if missing else Exit.FAILED)
    raise typer.Exit(code)


@cli.command()
def prune(older_than: Annotated[str, typer.Option("--older-than", help="e.g. 7d, 12h, 30m")]) -> None:
    """Delete finished tasks (and their attempts) older than DURATION."""
    from tasks_core.durations import parse_duration

    try:
        seconds = parse_duration(older_than)
    except ValueError as exc:
        _fail(str(exc), Exit.USAGE)
    if seconds > MAX_PRUNE_DAYS * 86400:
        _fail(f"--older-than {older_than}: at most {MAX_PRUNE_DAYS}d (100 years)", Exit.USAGE)

    async def go() -> int:
        async with client_services() as services:
            pruned: int = await services.repo.prune(seconds)
            return pruned

    typer.echo(f"pruned {run_command(go)} tasks")


@cli.command()
def dev(
    data_dir: Annotated[
        str | None, typer.Option(help="embedded data, logs, ports and session key (default .dtask)")
    ] = None,
    api_port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    flower_port: Annotated[int, typer.Option(min=1, max=65535)] = 5555,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="show the children's logs here")] = False,
) -> None:
    """Run the whole system on embedded PostgreSQL and Redis, supervised, until Ctrl-C/SIGTERM/SIGHUP."""
    from tasks_core.devkit.dev import run_dev

    sys.exit(
        run_dev(
            get_settings(), data_dir=data_dir, api_port=api_port, flower_port=flower_port, verbose=verbose
        )
    )


from tasks_core.devkit.bench.cli import bench_app  # noqa: E402  (typer sub-app; imports nothing heavy)

cli.add_typer(bench_app, name="bench")

from tasks_core.devkit.chaos.cli import chaos_command  # noqa: E402  (imports nothing heavy)
from tasks_core.registry import DOMAIN_CLIS, import_path  # noqa: E402

cli.command("chaos")(chaos_command)


for _name, _path in DOMAIN_CLIS:
    cli.add_typer(import_path(_path), name=_name)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
