"""The `dtask` command line against the real database (commands run in-process via typer)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url
from typer.testing import CliRunner

from app.main import create_app
from tasks_core.db import head_revision
from tasks_core.devkit.embedded import free_port
from tasks_core.ops.cli import cli
from tasks_core.services import build_services
from tests.conftest import make_settings

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def dtask(*args: str) -> Any:
    return runner.invoke(cli, list(args), catch_exceptions=False)


def http_get(path: str) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        svc = build_services(make_settings(api_keys="ops:ops-secret-0123456789:admin"), pool_size=1)
        try:
            app = create_app(services=svc)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                r = await c.get(path, headers={"Authorization": "Bearer ops-secret-0123456789"})
                assert r.status_code == 200
                return dict(r.json())
        finally:
            await svc.close()

    return asyncio.run(go())


@pytest.fixture
def fresh(clean_db: None) -> None:
    return None


def test_submit_show_list_cancel_prune(fresh: None) -> None:
    out = dtask("submit", "diagnostics.sleep", "--payload", '{"seconds": 5}', "--dedupe-key", "cli-1")
    assert out.exit_code == 0, out.output
    task_id = out.stdout.strip().splitlines()[-1]
    uuid.UUID(task_id)

    shown = dtask("show", task_id, "--json")
    assert shown.exit_code == 0
    assert json.loads(shown.stdout) == http_get(f"/tasks/{task_id}")  # exactly the HTTP object

    dup = dtask("submit", "diagnostics.sleep", "--payload", "{}", "--dedupe-key", "cli-1")
    assert dup.exit_code == 0 and task_id in dup.stdout

    listed = json.loads(dtask("list", "--json").stdout)
    assert [t["id"] for t in listed["items"]] == [task_id] and listed["next_cursor"] is None

    assert "cancelled" in dtask("cancel", task_id).stdout
    assert dtask("cancel", task_id).exit_code == 5  # already finished
    assert json.loads(dtask("show", task_id, "--json").stdout)["status"] == "cancelled"
    assert "pruned 0 tasks" in dtask("prune", "--older-than", "7d").stdout


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (("submit", "no.such.type"), 2),
        (("submit", "diagnostics.noop", "--payload", "[1]"), 2),
        (("submit", "diagnostics.noop", "--payload", "{not json"), 2),
        (("submit", "diagnostics.noop", "--timeout", "inf"), 2),
        (("submit", "diagnostics.noop", "--delay", "5", "--run-at", "2030-01-01T00:00:00Z"), 2),
        (("submit", "diagnostics.noop", "--run-at", "2030-01-01T00:00:00"), 2),
        (("submit", "diagnostics.noop", "--delay", "nan"), 2),
        (("submit", "diagnostics.noop", "--priority", "101"), 2),
        (("show", "not-a-uuid"), 2),
        (("show", str(uuid.uuid4())), 4),
        (("cancel", str(uuid.uuid4())), 4),
        (("prune", "--older-than", "soon"), 2),
        (("prune", "--older-than", "-5m"), 2),
        (("list", "--cursor", "garbage"), 2),
    ],
)
def test_bad_input_exits_non_zero_and_changes_nothing(fresh: None, args: tuple[str, ...], code: int) -> None:
    result = dtask(*args)
    assert result.exit_code == code, result.output
    assert json.loads(dtask("list", "--json").stdout)["items"] == []


def test_db_status_reports_current_schema(fresh: None) -> None:
    result = dtask("db-status")
    assert result.exit_code == 0 and f"database: {head_revision()}" in result.stdout


# ----------------------------------------------------------------------------- database problems
# One line naming the fix and a distinct exit code per kind, for every command that needs the database.

UNKNOWN_ID = str(uuid.uuid4())
DB_COMMANDS = [
    ("list",),
    ("show", UNKNOWN_ID),
    ("submit", "diagnostics.noop"),
    ("cancel", UNKNOWN_ID),
    ("prune", "--older-than", "7d"),
    ("db-status",),
]


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Change DTASK_* variables for in-process commands (settings are cached per process)."""
    from tasks_core.settings import get_settings

    def set_env(**values: str | None) -> None:
        for name, value in values.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        get_settings.cache_clear()

    yield set_env
    monkeypatch.undo()
    get_settings.cache_clear()


@pytest.fixture(scope="module")
def empty_database() -> Iterator[str]:
    """A database that exists but was never migrated."""
    from tasks_core.devkit.embedded import create_database, drop_database

    admin = os.environ["DTASK_TEST_ADMIN_URL"]
    name = f"dtask_unmigrated_{uuid.uuid4().hex[:8]}"
    url = create_database(admin, name)
    yield url
    drop_database(admin, name)


def _database_url(kind: str, empty_database: str) -> str:
    session = make_url(os.environ["DTASK_DATABASE_URL"])
    if kind == "unreachable":
        return session.set(host="127.0.0.1", port=free_port()).render_as_string(hide_password=False)
    if kind == "missing":
        return session.set(database=f"dtask_missing_{uuid.uuid4().hex[:8]}").render_as_string(
            hide_password=False
        )
    if kind == "login":  # a role the server does not know: refused even under trust auth
        return session.set(username=f"dtask_nobody_{uuid.uuid4().hex[:8]}").render_as_string(
            hide_password=False
        )
    return empty_database


@pytest.mark.parametrize("command", DB_COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize(
    ("kind", "code", "hint"),
    [
        ("unreachable", 6, "cannot reach the database"),
        ("missing", 7, "does not exist"),
        ("login", 8, "refused the login"),
        ("unmigrated", 3, "run `dtask migrate`"),
    ],
)
def test_database_problems_print_one_line_with_a_distinct_exit_code(
    env: Callable[..., None],
    empty_database: str,
    command: tuple[str, ...],
    kind: str,
    code: int,
    hint: str,
) -> None:
    env(DTASK_DATABASE_URL=_database_url(kind, empty_database))
    result = dtask(*command)
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and hint in lines[0], result.stderr


def test_a_plain_postgresql_url_is_used_with_asyncpg(fresh: None, env: Callable[..., None]) -> None:
    plain = os.environ["DTASK_DATABASE_URL"].replace("postgresql+asyncpg://", "postgresql://", 1)
    env(DTASK_DATABASE_URL=plain)
    assert dtask("db-status").exit_code == 0
    listed = dtask("list", "--json")
    assert listed.exit_code == 0 and json.loads(listed.stdout)["items"] == []


def test_prune_with_an_overflowing_age_is_one_line(fresh: None) -> None:
    result = dtask("prune", "--older-than", "99999999999999w")
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


# ----------------------------------------------------------------------------- what a person reads


def test_a_payload_its_type_refuses_is_one_line_naming_each_field(fresh: None) -> None:
    """The type's payload model checks a CLI submission as it checks an HTTP one; nothing is stored."""
    result = dtask("submit", "diagnostics.sleep", "--payload", '{"seconds": -1, "bogus": 1}')
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "seconds" in lines[0] and "bogus" in lines[0], result.stderr
    assert json.loads(dtask("list", "--json").stdout)["items"] == []


def test_list_rejects_an_unknown_status_naming_the_valid_ones(fresh: None) -> None:
    result = dtask("list", "--status", "bogus")
    assert result.exit_code == 2
    for status in ("pending", "running", "success", "failed", "cancelled"):
        assert status in result.stderr


def test_submit_later_and_first(fresh: None) -> None:
    task_id = dtask("submit", "diagnostics.noop", "--delay", "3600", "--priority", "7").stdout.split()[-1]
    shown = json.loads(dtask("show", task_id, "--json").stdout)
    assert shown["priority"] == 7 and shown["waiting_reason"] == f"scheduled for {shown['run_at']}"
    at = dtask("submit", "diagnostics.noop", "--run-at", "2030-01-02T03:04:05+02:00").stdout.split()[-1]
    assert json.loads(dtask("show", at, "--json").stdout)["run_at"] == "2030-01-02T01:04:05Z"


def test_retry_submits_a_cancelled_task_again_once(fresh: None) -> None:
    old = dtask("submit", "diagnostics.noop", "--priority", "3").stdout.split()[-1]
    assert dtask("cancel", old).exit_code == 0
    retried = dtask("retry", old)
    assert retried.exit_code == 0, retried.output
    first, new = retried.stdout.split()
    assert first == old
    shown = json.loads(dtask("show", new, "--json").stdout)
    assert (shown["retry_of"], shown["priority"], shown["status"]) == (old, 3, "pending")
    again = dtask("retry", old)
    assert again.exit_code == 1 and f"already retried ({new})" in again.output
    assert dtask("retry", str(uuid.uuid4())).exit_code == 4
    assert dtask("retry", "nope").exit_code == 2


def test_list_has_a_header_row(fresh: None) -> None:
    task_id = dtask("submit", "diagnostics.noop").stdout.strip().splitlines()[-1]
    lines = dtask("list").stdout.splitlines()
    assert lines[0].split() == ["ID", "STATUS", "PROGRESS", "TYPE", "CREATED"]
    assert lines[1].startswith(task_id)


def test_show_prints_what_a_person_reads(fresh: None, database_url: str) -> None:
    task_id = dtask("submit", "diagnostics.sleep", "--payload", '{"seconds": 1}').stdout.split()[-1]

    async def set_progress() -> None:
        from sqlalchemy import text

        from tasks_core.db import make_engine

        engine = make_engine(database_url, pool_size=1)
        async with engine.begin() as conn:
            await conn.execute(text("UPDATE tasks SET progress = 100.0 / 15 WHERE id = :id"), {"id": task_id})
        await engine.dispose()

    asyncio.run(set_progress())
    shown = dtask("show", task_id)
    assert shown.exit_code == 0
    words = set(shown.stdout.replace(":", " ").split())
    assert not words & {"None", "False", "True"}, shown.stdout
    assert "6.666666" not in shown.stdout and "6.7%" in shown.stdout, shown.stdout


def test_exit_codes_are_documented_in_help() -> None:
    text = dtask("--help").stdout
    assert "Exit codes" in text
    for code in range(2, 8):
        assert f" {code} " in text or f" {code}:" in text, text


# ----------------------------------------------------------------------------- broker and publishing


def test_submit_without_a_broker_refuses_in_one_line(fresh: None, env: Callable[..., None]) -> None:
    broker = os.environ["DTASK_BROKER_URL"]
    env(DTASK_BROKER_URL=None, DTASK_REDIS_URL=None)
    result = dtask("submit", "diagnostics.noop")
    assert result.exit_code != 0
    # (CliRunner shows a SystemExit message on stdout; a terminal gets it on stderr.)
    assert len(result.output.strip().splitlines()) == 1 and "DTASK_BROKER_URL" in result.output
    env(DTASK_BROKER_URL=broker)  # nothing was stored either
    assert json.loads(dtask("list", "--json").stdout)["items"] == []


def _subprocess_env(**overrides: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DTASK_CAPACITY"}
    env["PYTHONPATH"] = str(ROOT)
    for name, value in overrides.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def test_celery_has_no_hidden_default_broker(tmp_path: Path) -> None:
    probe = (
        "from tasks_core.celery_app import app\n"
        "print(app.conf.broker_url)\n"
        "try:\n"
        "    app.send_task('dtask.run', args=['x'])\n"
        "except Exception as exc:\n"
        "    print('refused:', exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env=_subprocess_env(DTASK_BROKER_URL=None, DTASK_REDIS_URL=None),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    configured = out.stdout.splitlines()[0]
    assert "127.0.0.1:6379" not in configured and "amqp" not in configured, out.stdout + out.stderr
    assert "refused: DTASK_BROKER_URL is not set" in out.stdout, out.stdout + out.stderr


def test_a_failed_publish_at_submit_is_reported_once(fresh: None, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tasks_core.ops.cli", "submit", "diagnostics.noop"],
        env=_subprocess_env(DTASK_BROKER_URL=f"redis://127.0.0.1:{free_port()}/0"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    uuid.UUID(out.stdout.strip())
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "not published yet" in out.stderr


def test_ctrl_c_while_waiting_says_the_task_goes_on(fresh: None, tmp_path: Path) -> None:
    # No worker runs: the task stays pending while the command waits.
    proc = subprocess.Popen(
        [sys.executable, "-m", "tasks_core.ops.cli", "submit", "diagnostics.noop", "--wait"],
        env=_subprocess_env(),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        task_id = proc.stdout.readline().strip()
        uuid.UUID(task_id)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert "goes on" in err and f"dtask show {task_id}" in err and f"dtask cancel {task_id}" in err, err


def test_submit_with_the_same_idempotency_key_returns_the_first_task(fresh: None) -> None:
    first = dtask("submit", "diagnostics.noop", "--payload", '{"n": 1}', "--idempotency-key", "retry-1")
    again = dtask("submit", "diagnostics.noop", "--payload", '{"n": 1}', "--idempotency-key", "retry-1")
    assert first.exit_code == again.exit_code == 0, (first.output, again.output)
    assert first.stdout.strip().splitlines()[-1] == again.stdout.strip().splitlines()[-1]
    other = dtask("submit", "diagnostics.noop", "--payload", '{"n": 2}', "--idempotency-key", "retry-1")
    assert other.exit_code != 0 and "different request" in other.output
    listed = json.loads(dtask("list", "--json").stdout)
    assert len(listed["items"]) == 1


def test_submit_counts_its_publish_in_the_shared_metrics(fresh: None, redis_client: Any) -> None:
    from tasks_core.metrics import METRICS_KEY

    redis_client.delete(METRICS_KEY)
    assert dtask("submit", "diagnostics.noop").exit_code == 0
    fields = {k.decode(): float(v) for k, v in redis_client.hgetall(METRICS_KEY).items()}
    assert fields.get("dtask_published|by=submit") == 1.0, fields


def test_worker_refuses_a_pool_it_does_not_support(fresh: None) -> None:
    # gevent/eventlet would each need a loop per greenlet; only prefork, threads and solo are run.
    out = dtask("worker", "--pool", "gevent")
    assert out.exit_code == 2 and "use prefork, threads, solo" in out.output


def test_submit_refuses_a_domains_own_type(fresh: None) -> None:
    out = dtask("submit", "knowledge.ingest", "--payload", '{"file_id": "' + "0" * 32 + '"}')
    assert out.exit_code == 2 and "created by their domain's own routes" in out.output
