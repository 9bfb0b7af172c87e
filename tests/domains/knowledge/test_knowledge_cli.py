"""The README's shell path: `python -m domains.knowledge.cli` against a live API (uvicorn on a
loopback port), real stores; the tasks run in this process through the real runtime."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from domains.knowledge.cli import cli
from tasks_core.services import build_services
from tests.conftest import make_settings
from tests.knowledge_helpers import KEYS, run_pending
from tests.live_api import serve

pytestmark = pytest.mark.usefixtures("clean_db")
SECRET = "alice-secret-0123456"


@pytest.fixture
def live_api(knowledge_stores: dict[str, str]) -> Iterator[str]:
    from app.main import create_app

    with serve(create_app(settings=make_settings(api_keys=KEYS))) as url:
        yield url


def invoke(api: str, *args: str) -> str:
    result = CliRunner().invoke(cli, [*args, "--api", api, "--key", SECRET])
    assert result.exit_code == 0, result.output
    return result.output


def test_create_upload_a_folder_watch_and_search(live_api: str, tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    (docs / "deep").mkdir(parents=True)
    (docs / "ferns.md").write_text("# Ferns\n\nFerns reproduce by spores, not seeds.")
    (docs / "deep" / "moss.txt").write_text("Mosses hold water like a sponge on the forest floor.")
    (docs / "deep" / "image.png").write_bytes(b"\x89PNG")

    base = invoke(live_api, "create-base", "botany").strip()
    uploaded = invoke(live_api, "upload", base, str(docs))
    assert "ferns.md" in uploaded and "moss.txt" in uploaded and "uploaded 2 files" in uploaded
    assert "skipped (not one of .txt" in uploaded and "image.png" in uploaded

    async def run() -> None:
        svc = build_services(make_settings(), pool_size=2)
        try:
            await run_pending(svc)
        finally:
            await svc.close()

    asyncio.run(run())
    assert invoke(live_api, "files", base, "--watch").strip() == "2 indexed"
    assert "botany" in invoke(live_api, "bases") and "2 indexed" in invoke(live_api, "bases")
    hits = invoke(live_api, "search", base, "spores seeds ferns", "--top-k", "1").splitlines()
    assert len(hits) == 1 and "ferns.md  # Ferns Ferns reproduce by spores" in hits[0], hits
    assert invoke(live_api, "search", base, "spores seeds ferns", "--min-score", "0.99").strip() == ""
    # The same folder again: the same files, nothing indexed twice.
    again = invoke(live_api, "upload", base, str(docs))
    assert "uploaded 2 files: 2 duplicates" in again and again.count("not indexed again") == 2, again


@pytest.mark.parametrize(
    ("key", "api", "code", "says"),
    [
        ("", None, 2, "no API key"),
        ("two words", None, 2, "spaces or control characters"),
        ("not-a-key-of-anyone", None, 1, "401: the API refused the key"),
        (SECRET, "http://127.0.0.1:9", 1, "cannot reach the API at http://127.0.0.1:9"),
    ],
    ids=["missing", "malformed", "wrong", "unreachable"],
)
def test_a_missing_wrong_or_unusable_key_or_api_is_one_line_and_an_exit_code(
    live_api: str, key: str, api: str | None, code: int, says: str
) -> None:
    result = CliRunner().invoke(cli, ["bases", "--api", api or live_api, "--key", key])
    assert result.exit_code == code, result.output
    assert says in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
