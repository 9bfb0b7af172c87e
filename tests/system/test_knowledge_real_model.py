"""Knowledge bases on a real embedding model: a worker and the api with DTASK_EMBEDDER=openai talk to
infinity serving all-MiniLM-L6-v2 (scripts/model-server), and a query that shares almost no word
with its document finds it — by a clear margin, which a lexical embedder cannot give."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import text

from domains.knowledge import stores
from domains.knowledge.cache import PerProcess
from tests.knowledge_helpers import ALICE, create_base, knowledge_api, upload
from tests.model_server import model_server  # noqa: F401  (the session's model server)
from tests.system.conftest import Cluster, wait_for

pytestmark = [pytest.mark.system, pytest.mark.timeout(1200)]  # a first run installs the server

DOCUMENTS = {
    "plants.md": "Photosynthesis lets plants turn sunlight, water and carbon dioxide into sugar and oxygen.",
    "markets.md": "The stock market fell sharply after the central bank raised interest rates again.",
    "football.md": "Our team won the football match with a goal scored in the final minute of play.",
    "bread.md": "To bake bread, knead the dough, leave it to rise, then put it in a hot oven.",
    "volcano.md": "The volcano erupted, sending ash and lava down the slopes of the mountain.",
}


@pytest.fixture
def real_model(model_server: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:  # noqa: F811
    # No DTASK_EMBEDDING_DIMENSION: the api and the worker each ask the server once.
    env = {k: v for k, v in model_server.items() if k != "DTASK_EMBEDDING_DIMENSION"}
    monkeypatch.setattr(stores, "_registry", PerProcess())  # the api's embedder, for this test only
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    yield env


async def test_a_paraphrased_query_finds_its_document_through_a_real_model(
    cluster: Cluster, knowledge_stores: dict[str, str], real_model: dict[str, str]
) -> None:
    worker = cluster.start_worker(concurrency=2, **knowledge_stores, **real_model)
    await cluster.wait_worker_ready(worker)
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        r = await upload(client, base, [(name, body.encode()) for name, body in DOCUMENTS.items()])
        assert r.status_code == 202, r.text

        async def indexed() -> bool:
            assert worker.alive()
            async with svc.engine.connect() as conn:
                rows = (
                    await conn.execute(
                        text("SELECT status, error_message FROM knowledge_files WHERE kb_id = :kb"),
                        {"kb": base},
                    )
                ).all()
            assert all(status != "error_indexing" for status, _ in rows), rows
            return len(rows) == len(DOCUMENTS) and all(status == "indexed" for status, _ in rows)

        await wait_for(indexed, within=90, interval=0.3, what="the documents indexed")
        row = (await client.get(f"/knowledge/bases/{base}", headers=ALICE)).json()
        assert (row["embedder"], row["dimension"]) == ("openai:all-MiniLM-L6-v2", 384)  # probed
        r = await client.post(
            f"/knowledge/bases/{base}/search",
            json={"query": "how do green leaves make food from light?", "top_k": 3},
            headers=ALICE,
        )
        assert r.status_code == 200, r.text
        hits = r.json()["hits"]
        assert hits[0]["filename"] == "plants.md", hits
        # A clear margin (0.62 against 0.14 here); the hashing embedder ranks it first by 0.003.
        assert hits[0]["score"] - hits[1]["score"] > 0.2, hits
