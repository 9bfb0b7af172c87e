"""DTASK_GRAPH_EXTRACTOR=llm: entities a model endpoint names, counted from the text itself. A build
on the real runtime and database survives an outage mid-build (the retry-safe build goes back to
pending and resumes at its checkpoint, ending with exactly the clean graph) and fails at once, with
the endpoint's message, when the server refuses the request."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from domains.graph.extraction import MAX_NAME_CHARS, load_extractor
from domains.graph.llm_extractor import PLACEHOLDERS, Entity, occurrences
from domains.llm_prompt import load_prompt
from tasks_core.worker.runtime import run_task
from tests.graph_helpers import NAMES, build_row, corpus, expected_tables, graph_tables, make_base
from tests.knowledge_helpers import ALICE, knowledge_api
from tests.llm_endpoint import Reply, ScriptedEndpoint, Seen, completion, passage

SHIPPED = load_prompt("domains.graph", "entities.txt", "", "DTASK_GRAPH_LLM_PROMPT", PLACEHOLDERS)


def _namer(seen: Seen) -> Reply:
    """A model that lists the known names its passage holds (and one the passage does not)."""
    text = passage(seen.prompt)
    found = [{"name": n, "mentions": [n]} for n in NAMES if n in text]
    return completion(json.dumps({"entities": [*found, {"name": "Atlantis", "mentions": ["Atlantis"]}]}))


def test_occurrences_are_found_in_the_text_in_order_longest_form_first() -> None:
    text = "Marie Curie met Einstein. Later Curie wrote to Einstein; Adams is not Ada. Ada smiled."
    entities = [
        Entity(name="Albert Einstein", mentions=["Einstein"]),
        Entity(name="Marie Curie", mentions=["Curie", "Marie Curie"]),
        Entity(name="Ada", mentions=[]),
        Entity(name="Atlantis", mentions=["Atlantis"]),  # not in the text: dropped
    ]
    assert occurrences(text, entities) == [
        "Marie Curie", "Albert Einstein", "Marie Curie", "Albert Einstein", "Ada", "Ada",
    ]  # fmt: skip
    # CJK names sit between other characters with no spaces.
    chinese = "居里夫人在巴黎工作\uff0c后来回到巴黎。"  # with a Chinese comma
    assert occurrences(chinese, [Entity(name="巴黎"), Entity(name="居里夫人")]) == [
        "居里夫人",
        "巴黎",
        "巴黎",
    ]
    # A name the graph could not store is left out; whitespace inside a name is normalised.
    long = "X" * (MAX_NAME_CHARS + 1)
    assert occurrences(f"{long} and Bo", [Entity(name=long), Entity(name="Bo")]) == ["Bo"]
    assert occurrences("New  York, New York", [Entity(name="New\nYork", mentions=["New York"])]) == [
        "New York"
    ]


def test_the_extractor_takes_bare_names_too_and_asks_nothing_of_an_empty_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with ScriptedEndpoint([completion('{"entities": ["Paris", {"name": "Seine"}]}')]).running() as server:
        monkeypatch.setenv("DTASK_LLM_URL", server.url)
        monkeypatch.setenv("DTASK_LLM_MODEL", "m")
        extractor = load_extractor("llm")
        assert extractor.extract("  \n ") == []
        assert extractor.extract("Paris lies on the Seine. Paris.") == ["Paris", "Seine", "Paris"]
    assert len(server.seen) == 1
    assert extractor.name == f"llm:m prompt:{SHIPPED.digest}"


@pytest.fixture
def llm_graph(monkeypatch: pytest.MonkeyPatch) -> Any:
    def point_at(server: ScriptedEndpoint) -> None:
        monkeypatch.setenv("DTASK_GRAPH_EXTRACTOR", "llm")
        monkeypatch.setenv("DTASK_GRAPH_BATCH_CHUNKS", "3")
        monkeypatch.setenv("DTASK_LLM_URL", server.url)
        monkeypatch.setenv("DTASK_LLM_MODEL", "test-model")
        monkeypatch.setenv("DTASK_LLM_MAX_TRIES", "1")

    return point_at


@pytest.mark.usefixtures("clean_db")
async def test_an_outage_mid_build_is_retried_from_the_checkpoint_to_exactly_the_clean_graph(
    llm_graph: Any,
) -> None:
    files = corpus(files=2, chunks_per_file=5)
    outage = {"at": 4, "left": 1}  # the 5th request (second batch) meets one 503

    def flaky(seen: Seen) -> Reply:
        if len(server.seen) == outage["at"] + 1 and outage["left"]:
            outage["left"] -= 1
            return Reply(503, {"error": {"message": "upstream overloaded"}}, {"Retry-After": "0"})
        return _namer(seen)

    with ScriptedEndpoint(flaky).running() as server:
        llm_graph(server)
        async with knowledge_api() as (client, svc):
            base, _ = await make_base(svc, files)
            r = await client.post(f"/graph/{base}/build", headers=ALICE)
            assert r.status_code == 202, r.text
            task_id, build_id = r.json()["task_id"], uuid.UUID(r.json()["build_id"])
            assert (await run_task(svc, task_id)).status == "pending"
            task = (await client.get(f"/tasks/{task_id}", headers=ALICE)).json()
            assert "llm_unavailable" in task["message"] and "upstream overloaded" in task["message"]
            assert (await build_row(svc, build_id))["chunks_done"] == 3  # the first batch is kept
            assert (await run_task(svc, task_id)).status == "success"
            task = (await client.get(f"/tasks/{task_id}", headers=ALICE)).json()
            row = await build_row(svc, build_id)
            tables = await graph_tables(svc, build_id)
    assert (task["status"], task["attempt_count"]) == ("success", 2)
    assert row["extractor"] == f"llm:test-model prompt:{SHIPPED.digest}"
    assert tables == expected_tables([t for f in files for t in f])
    # Each chunk asked once, the batch that met the outage asked again from its first chunk.
    assert len(server.seen) == 10 + 2


@pytest.mark.usefixtures("clean_db")
async def test_a_refusal_fails_the_build_at_once_with_the_endpoints_message(llm_graph: Any) -> None:
    with ScriptedEndpoint(
        [Reply(401, {"error": {"message": "Incorrect API key provided: sk-...xyz."}})]
    ).running() as server:
        llm_graph(server)
        async with knowledge_api() as (client, svc):
            base, _ = await make_base(svc, corpus(files=1, chunks_per_file=2))
            r = await client.post(f"/graph/{base}/build", headers=ALICE)
            task_id, build_id = r.json()["task_id"], uuid.UUID(r.json()["build_id"])
            assert (await run_task(svc, task_id)).status == "failed"
            task = (await client.get(f"/tasks/{task_id}", headers=ALICE)).json()
            row = await build_row(svc, build_id)
    assert task["attempt_count"] == 1 and len(server.seen) == 1
    assert task["error"]["message"] == (
        f"LLMRefused: {server.url}/chat/completions answered 401 (DTASK_LLM_API_KEY): "
        "Incorrect API key provided: sk-...xyz."
    )
    assert row["status"] == "failed"
