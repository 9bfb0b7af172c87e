"""DTASK_EVAL_GENERATOR=llm and DTASK_GRAPH_EXTRACTOR=llm through a real model: llama-cpp-python's
OpenAI-compatible server running the small Gemma 3 GGUF that scripts/llm-server installs. A base
model of 270M parameters writes poor questions; what is checked is the protocol (JSON mode, the
parsing, the chat template) and that a dataset and a graph build complete with what it wrote.

Skipped unless `scripts/llm-server install` has run on this machine (a ten-minute build); under
CI, which installs it, a missing server fails instead."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.evaluation_helpers import TOPICS, dataset_row, document, indexed_base, items
from tests.graph_helpers import build_row, graph_tables, make_base
from tests.knowledge_helpers import ALICE, knowledge_api, run_pending
from tests.tools import require

pytestmark = pytest.mark.llm_server

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "llm-server"
MODEL = "gemma-3-270m-q4_k_m"
# The tests' 3 s lease is renewed from the event loop; a loaded 2-core machine running a model can
# starve it past that, and the point here is the model, not lease loss.
LEASE = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def llm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    status = subprocess.run([SCRIPT, "status"], capture_output=True, text=True, check=False)
    require(
        status.returncode == 0,
        "llama-cpp-python's server",
        f"{status.stderr.strip()}; `scripts/llm-server install` builds it once, about 11 minutes on 2 "
        "cores, and .ci/run does",
    )
    port = _free_port()
    log_path = tmp_path_factory.mktemp("llm-server") / "server.log"
    with log_path.open("wb") as log:
        # One thread: the other core stays for PostgreSQL, the stores and the runtime's lease renewals.
        server = subprocess.Popen(
            [SCRIPT, "run", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "LLM_SERVER_THREADS": "1"},
        )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, log_path.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/models", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"the server did not start: {log_path.read_text()[-3000:]}"
            time.sleep(0.3)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(3)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(5)


@pytest.fixture
def llm_env(llm_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTASK_LLM_URL", llm_server)
    monkeypatch.setenv("DTASK_LLM_MODEL", MODEL)
    # The server generates one reply at a time on this machine's cores; short replies keep it fast.
    monkeypatch.setenv("DTASK_LLM_CONCURRENCY", "1")
    monkeypatch.setenv("DTASK_LLM_MAX_TOKENS", "96")
    monkeypatch.setenv("DTASK_LLM_TIMEOUT_SECONDS", "120")


@pytest.mark.usefixtures("clean_db", "llm_env")
async def test_a_real_model_writes_a_small_dataset(
    knowledge_stores: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DTASK_EVAL_GENERATOR", "llm")
    async with knowledge_api(lease_seconds=LEASE) as (client, svc):
        base, _ = await indexed_base(client, svc, [(f"{t}.txt", document(t, 1)) for t in TOPICS[:3]])
        r = await client.post("/evaluation/datasets", json={"base_id": base, "size": 3}, headers=ALICE)
        assert r.status_code == 202, r.text
        outcome = await run_pending(svc)
        task = (await client.get(f"/tasks/{r.json()['task_id']}", headers=ALICE)).json()
        assert outcome == ["success"], task["error"]
        dataset = await dataset_row(svc, r.json()["id"])
        stored = await items(svc, dataset["id"])
    assert (dataset["status"], dataset["item_count"]) == ("completed", 3)
    assert dataset["generator"].startswith(f"llm:{MODEL} prompt:")
    assert len({i["chunk_id"] for i in stored}) == 3
    assert all(i["question"].strip() and i["answer"].strip() for i in stored)


@pytest.mark.usefixtures("clean_db", "llm_env")
async def test_a_real_model_names_the_entities_of_a_graph_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTASK_GRAPH_EXTRACTOR", "llm")
    text = "Marie Curie worked in Paris with Pierre Curie. Later Marie Curie won the Nobel Prize."
    async with knowledge_api(lease_seconds=LEASE) as (client, svc):
        base, _ = await make_base(svc, [[text]])
        r = await client.post(f"/graph/{base}/build", headers=ALICE)
        assert r.status_code == 202, r.text
        assert await run_pending(svc) == ["success"]
        row = await build_row(svc, r.json()["build_id"])
        entities, _ = await graph_tables(svc, r.json()["build_id"])
    assert row["extractor"].startswith(f"llm:{MODEL} prompt:")
    # Whatever the model named, only what the text holds is counted, each within the chunk.
    assert all(name in text and 1 <= chunks <= mentions for name, mentions, chunks in entities), entities


def test_the_script_says_when_it_is_not_installed() -> None:
    # The skip above is the script's verdict; its cache can be put elsewhere (a CI cache).
    env = {**os.environ, "DTASK_LLM_SERVER_CACHE": "/nonexistent/llm-server-cache"}
    status = subprocess.run([SCRIPT, "status"], capture_output=True, text=True, env=env, check=False)
    assert status.returncode == 1
    assert "not installed in /nonexistent/llm-server-cache (scripts/llm-server install)" in status.stderr
