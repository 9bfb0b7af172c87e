"""The `dtask` command line against the real database (commands run in-process via typer)."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from app.main import create_app
from tasks_core.cli import cli
from tasks_core.db import head_revision
from tasks_core.services import build_services
from tests.conftest import make_settings

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
