"""The README's shell path for evaluation: `python -m domains.evaluation.cli` against a live API
(uvicorn on a loopback port) and real stores; tasks run in this process through the real runtime."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from domains.evaluation.cli import cli
from domains.knowledge.cli import cli as knowledge_cli
from tasks_core.services import build_services
from tests.conftest import make_settings
from tests.domains.knowledge.test_knowledge_cli import SECRET, live_api  # noqa: F401 (a fixture)
from tests.evaluation_helpers import document
from tests.knowledge_helpers import run_pending

pytestmark = pytest.mark.usefixtures("clean_db")


def invoke(api: str, *args: str, app: object = cli) -> str:
    result = CliRunner().invoke(app, [*args, "--api", api, "--key", SECRET])  # type: ignore[arg-type]
    assert result.exit_code == 0, result.output
    return result.output


def run_tasks() -> list[str]:
    async def run() -> list[str]:
        svc = build_services(make_settings(), pool_size=2)
        try:
            return await run_pending(svc)
        finally:
            await svc.close()

    return asyncio.run(run())


def test_generate_interrupt_resume_and_evaluate_from_a_shell(live_api: str, tmp_path: Path) -> None:  # noqa: F811
    for topic in ("river", "orbit"):
        (tmp_path / f"{topic}.txt").write_text(document(topic))
    base = invoke(live_api, "create-base", "eval", app=knowledge_cli).strip()
    invoke(live_api, "upload", base, str(tmp_path), app=knowledge_cli)
    assert set(run_tasks()) == {"success"}

    dataset = invoke(live_api, "generate", base, "5").splitlines()[0]
    # Interrupted before it ran: its task cancelled, the dataset with it.
    with httpx.Client(base_url=live_api, headers={"Authorization": f"Bearer {SECRET}"}) as client:
        task_id = client.get(f"/evaluation/datasets/{dataset}").json()["task_id"]
        assert client.post(f"/tasks/{task_id}/cancel").status_code == 200
    assert "cancelled" in invoke(live_api, "dataset", dataset)

    resumed = invoke(live_api, "resume", dataset).strip()
    assert resumed != task_id
    assert run_tasks() == ["success"]
    assert f"completed  5 of 5 items  task {resumed}" in invoke(live_api, "dataset", dataset, "--watch")

    run_id = invoke(live_api, "run", dataset, base, "--top-k", "3").strip()
    assert run_tasks() == ["success"]
    shown = invoke(live_api, "show-run", run_id)
    assert "completed" in shown and "5 of 5 items" in shown and "hit@3" in shown and "MRR" in shown
