"""The README's shell path for graphs: `python -m domains.graph.cli` against a live API (uvicorn on
a loopback port); the build runs in this process through the real runtime."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner, Result

from domains.graph.cli import cli
from tasks_core.services import build_services
from tests.conftest import make_settings
from tests.graph_helpers import make_base
from tests.knowledge_helpers import KEYS, run_pending, scalar
from tests.live_api import serve

pytestmark = pytest.mark.usefixtures("clean_db")
SECRET = "alice-secret-0123456"


@pytest.fixture
def live_api() -> Iterator[str]:
    from app.main import create_app

    with serve(create_app(settings=make_settings(api_keys=KEYS))) as url:
        yield url


async def test_build_then_browse_from_the_shell(live_api: str) -> None:
    env = {"DTASK_API_URL": live_api, "DTASK_API_KEY": SECRET}
    runner = CliRunner()

    def dtask_graph(*args: str) -> Result:
        return runner.invoke(cli, list(args), env=env)

    svc = build_services(make_settings(), pool_size=2)
    try:
        base, _ = await make_base(svc, [["Then Ada met Bob and Ada again.", "Then Bob met Ada near Cyd."]])
        r = await asyncio.to_thread(dtask_graph, "build", base)
        assert r.exit_code == 0, r.output
        task_id = r.stdout.strip()
        assert await run_pending(svc) == ["success"]
        # A rebuild, followed with --wait until this process has run it.
        waiting = asyncio.create_task(asyncio.to_thread(dtask_graph, "build", base, "--wait"))
        for _ in range(400):  # until the CLI's request has committed its task (at most 20 s)
            if await scalar(svc, "SELECT count(*) FROM tasks WHERE status = 'pending'"):
                break
            await asyncio.sleep(0.05)
        assert await run_pending(svc) == ["success"]
        r = await waiting
        assert r.exit_code == 0 and "success: 2 chunks" in r.output and r.stdout.strip() != task_id
    finally:
        await svc.close()
    r = await asyncio.to_thread(dtask_graph, "entities", base)
    assert r.exit_code == 0, r.output
    rows = [line.split() for line in r.stdout.splitlines()]
    assert rows == [["3", "2", "Ada"], ["2", "2", "Bob"], ["1", "1", "Cyd"]]
    r = await asyncio.to_thread(dtask_graph, "neighbors", base, "Ada")
    assert [line.split() for line in r.stdout.splitlines()] == [["2", "Bob"], ["1", "Cyd"]]
    # An unknown entity: exit 1 with the API's answer.
    r = await asyncio.to_thread(dtask_graph, "neighbors", base, "Nobody")
    assert r.exit_code == 1 and "404" in r.output
