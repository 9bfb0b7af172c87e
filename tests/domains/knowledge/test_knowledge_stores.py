"""The store clients: blocking Milvus calls leave the event loop (and the heartbeat) free, and a
base's client is built once however many tasks ask for it at the same moment. Real milvus-lite."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any

import pytest
from repo_helpers import submit

from domains.knowledge.catalog import new_id
from domains.knowledge.stores import KnowledgeStores, StoreConfig, stores_for
from domains.knowledge.vectors import BaseIndex, collection_name
from tasks_core.settings import Settings
from tests.knowledge_helpers import milvus_client

BLOCK_SECONDS = 2.0
HEARTBEAT_EVERY = 0.1
LAG_BOUND = 0.1  # the promise: a store call never delays the heartbeat by more than 100 ms


class SlowClient:
    """The real MilvusClient, each call preceded by a 2 s sleep in the calling thread."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._real, name)

        @functools.wraps(method)
        def slow(*args: Any, **kwargs: Any) -> Any:
            time.sleep(BLOCK_SECONDS)
            return method(*args, **kwargs)

        return slow


async def _heartbeat_lags(services: Any, during: Callable[[], Any]) -> tuple[list[float], float]:
    """Run a real heartbeat (fenced lease renewal) every 100 ms while ``during`` runs; its lateness."""
    task_id = await submit(services.repo)
    claim = await services.repo.claim(task_id, services.registry, capacity=10, lease_seconds=10)
    loop = asyncio.get_running_loop()
    lags: list[float] = []

    async def heartbeat() -> None:
        while True:
            due = loop.time() + HEARTBEAT_EVERY
            await asyncio.sleep(HEARTBEAT_EVERY)
            lags.append(loop.time() - due)
            assert (await services.repo.heartbeat(task_id, claim.token, 10)).owned

    beats = asyncio.create_task(heartbeat())
    await asyncio.sleep(0.3)  # the heartbeat is running before the call starts
    started = time.monotonic()
    try:
        await during()
        elapsed = time.monotonic() - started
        await asyncio.sleep(2.5 * HEARTBEAT_EVERY)  # a beat that was held up gets to record it
    finally:
        beats.cancel()
        await asyncio.gather(beats, return_exceptions=True)
    return lags, elapsed


async def test_a_milvus_call_blocking_2s_does_not_delay_the_heartbeat(
    knowledge_stores: dict[str, str], services: Any
) -> None:
    stores = stores_for(Settings())
    base_id = new_id()
    real = await stores.index(base_id, stores.embedder.dimension)
    slow = BaseIndex(SlowClient(real.client), real.name, real.deadline)

    lags, elapsed = await _heartbeat_lags(services, lambda: slow.count())  # the production to_thread path
    assert elapsed >= BLOCK_SECONDS
    print(
        f"heartbeat lag during a {BLOCK_SECONDS:g} s Milvus call: max {max(lags) * 1000:.1f} ms "
        f"over {len(lags)} beats"
    )
    assert len(lags) >= BLOCK_SECONDS / HEARTBEAT_EVERY / 2
    assert max(lags) < LAG_BOUND

    # The measurement can fail: the same call made on the event loop stalls the heartbeat for 2 s.
    async def on_the_loop() -> None:
        SlowClient(real.client).query(real.name, filter="", output_fields=["count(*)"])

    lags, _ = await _heartbeat_lags(services, on_the_loop)
    assert max(lags) >= BLOCK_SECONDS * 0.9


async def test_ten_concurrent_tasks_build_a_bases_client_once(knowledge_stores: dict[str, str]) -> None:
    stores = KnowledgeStores(StoreConfig.from_settings(Settings()))  # a fresh cache, not the process's
    base_id = new_id()
    dimension = stores.embedder.dimension
    handles = await asyncio.gather(
        *(asyncio.create_task(stores.index(base_id, dimension)) for _ in range(10))
    )
    assert stores.indexes.builds == 1
    assert all(h is handles[0] for h in handles)
    assert milvus_client(knowledge_stores).has_collection(collection_name(base_id))
    # Another base is another build; the first is served from the cache.
    await asyncio.gather(stores.index(new_id(), dimension), stores.index(base_id, dimension))
    assert stores.indexes.builds == 2


@pytest.mark.parametrize("waiters", [10])
async def test_a_failed_build_is_not_cached(knowledge_stores: dict[str, str], waiters: int) -> None:
    """A build that fails (Milvus down at that moment) is retried by the next caller, not remembered."""
    from domains.knowledge.errors import StoreUnavailable
    from tasks_core.devkit.embedded import free_port

    config = StoreConfig.from_settings(Settings(milvus_uri=f"http://127.0.0.1:{free_port()}"))
    stores = KnowledgeStores(config)
    results = await asyncio.gather(
        *(stores.index(new_id(), 8) for _ in range(waiters)), return_exceptions=True
    )
    assert all(isinstance(r, StoreUnavailable) for r in results)
    assert stores.indexes.builds == 0


@pytest.mark.usefixtures("clean_db")
async def test_search_and_indexing_go_on_after_milvus_restarts(
    knowledge_stores: dict[str, str], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted server leaves collections released; cached handles reload them instead of 503s."""
    from tasks_core.devkit.embedded_stores import EmbeddedMilvus
    from tests.knowledge_helpers import ALICE, create_base, knowledge_api, run_pending, upload

    milvus = EmbeddedMilvus(tmp_path / "milvus")
    uri = milvus.start()
    monkeypatch.setenv("DTASK_MILVUS_URI", uri)  # the in-process worker reads its settings from here
    try:
        async with knowledge_api(milvus_uri=uri) as (client, svc):
            base = await create_base(client)
            await upload(client, base, [("a.txt", b"lantern harbor signal")])
            assert await run_pending(svc) == ["success"]
            milvus.stop()
            milvus = EmbeddedMilvus(tmp_path / "milvus", int(uri.rsplit(":", 1)[1]))
            assert milvus.start() == uri
            r = await client.post(f"/knowledge/bases/{base}/search", json={"query": "harbor"}, headers=ALICE)
            assert r.status_code == 200 and len(r.json()["hits"]) == 1, r.text
            # And a worker process that cached the handle indexes into it again.
            await upload(client, base, [("b.txt", b"meadow copper orchard")])
            assert await run_pending(svc) == ["success"]
            r = await client.post(f"/knowledge/bases/{base}/search", json={"query": "orchard"}, headers=ALICE)
            assert r.json()["hits"][0]["text"] == "meadow copper orchard"
    finally:
        milvus.stop()


async def test_a_wrong_request_is_an_error_of_ours_never_an_outage_to_wait_out(
    knowledge_stores: dict[str, str],
) -> None:
    """A vector of the wrong dimension fails the same way however often it is sent: retrying it as
    if Milvus were down would hold the file for all its attempts."""
    from domains.knowledge.errors import StoreError

    stores = stores_for(Settings())
    index = await stores.index(new_id(), stores.embedder.dimension)
    with pytest.raises(Exception) as failure:
        await index.upsert("f", ["f-0"], [[0.5] * 7])
    assert not isinstance(failure.value, StoreError), repr(failure.value)
