"""The OpenAI-compatible embedding client against a real HTTP server that fails on request
(tests/embedding_server.py): retries of 429/503/refused connections with Retry-After honoured,
the retry budget and its classification, permanent answers, batching, the concurrency bound, the
dimension probe, normalisation, and a cancel (a lost lease) stopping the retries."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import pytest

from domains.knowledge.embedding import embed_texts, load_embedder, mismatch
from domains.knowledge.errors import StoreUnavailable
from domains.knowledge.hashing import HashingEmbedder
from domains.knowledge.model_settings import EmbeddingSettings
from domains.knowledge.openai_embedder import (
    EmbeddingRejected,
    EmbeddingUnavailable,
    OpenAIEmbedder,
    retry_after_seconds,
)
from tasks_core import metrics
from tasks_core.retry import RetryableError
from tests.embedding_server import Answer, EmbeddingServer

DIM = 64


@pytest.fixture
def server() -> Iterator[EmbeddingServer]:
    s = EmbeddingServer(DIM).start()
    yield s
    s.stop()


def client(server: EmbeddingServer, **overrides: Any) -> OpenAIEmbedder:
    values: dict[str, Any] = {
        "embedding_url": server.url,
        "embedding_model": server.model,
        "embedding_dimension": DIM,
        "embedding_backoff_seconds": 0.05,
        "embedding_retry_seconds": 10.0,
        **overrides,
    }
    return OpenAIEmbedder(EmbeddingSettings(**values))


def retries(reason: str) -> float:
    """This process's unflushed count of retries for ``reason`` (what the worker adds to Redis)."""
    return metrics._deltas.get(metrics._field("dtask_embedding_retries", {"reason": reason}), 0.0)


def unit(vector: list[float]) -> bool:
    return math.isclose(math.sqrt(sum(v * v for v in vector)), 1.0, rel_tol=1e-9)


async def test_429_with_retry_after_then_503_then_vectors_in_order_and_normalised(
    server: EmbeddingServer,
) -> None:
    server.fail_next(
        Answer(429, {"Retry-After": "1"}, {"error": {"message": "rate limited"}}),
        Answer(503, body={"error": "model loading"}),
    )
    before_429, before_503 = retries("429"), retries("503")
    texts = ["alpha beta", "gamma delta", "epsilon"]
    vectors = await embed_texts(client(server), texts)
    assert len(server.requests) == 3
    assert server.requests[1].at - server.requests[0].at >= 1.0  # Retry-After: 1 honoured
    assert server.requests[2].at - server.requests[1].at < 1.0  # a backoff, not a second Retry-After
    expected = HashingEmbedder(DIM).embed(texts)
    # The server scales its vectors by 3 and answers them in reverse: ordered by index, unit length.
    for got, want in zip(vectors, expected, strict=True):
        assert unit(got)
        assert got == pytest.approx(want, abs=1e-9)
    assert (retries("429") - before_429, retries("503") - before_503) == (1, 1)


async def test_retry_after_as_an_http_date_is_honoured(server: EmbeddingServer) -> None:
    when = datetime.now(UTC) + timedelta(seconds=2)
    server.fail_next(Answer(503, {"Retry-After": format_datetime(when, usegmt=True)}))
    await client(server).aembed(["one"])
    gap = server.requests[1].at - server.requests[0].at
    assert 0.9 <= gap <= 2.5  # whole seconds in the date: between one and two seconds away


def test_retry_after_parsing() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC).timestamp()
    assert retry_after_seconds("7", now) == 7.0
    assert retry_after_seconds("Thu, 01 Jan 2026 00:00:30 GMT", now) == 30.0
    assert retry_after_seconds("Wed, 31 Dec 2025 23:00:00 GMT", now) == 0.0  # already past
    assert retry_after_seconds("soon", now) is None
    assert retry_after_seconds(None, now) is None
    assert retry_after_seconds("-3", now) == 0.0


async def test_a_server_that_stays_overloaded_past_the_budget_is_unavailable_not_rejected(
    server: EmbeddingServer,
) -> None:
    server.fail_every(1, Answer(503, body={"detail": "overloaded"}))
    embedder = client(server, embedding_retry_seconds=1.0, embedding_backoff_seconds=0.1)
    started = time.monotonic()
    with pytest.raises(EmbeddingUnavailable) as caught:
        await embedder.aembed(["one"])
    elapsed = time.monotonic() - started
    assert elapsed <= 2.0
    assert len(server.requests) >= 3
    # The ingest handler waits a StoreUnavailable out; the runtime retries a RetryableError.
    assert isinstance(caught.value, StoreUnavailable) and isinstance(caught.value, RetryableError)
    message = str(caught.value)
    assert "503 overloaded" in message and server.url in message and "\n" not in message
    assert caught.value.code == "embedding_unavailable"


async def test_a_retry_after_beyond_the_budget_gives_up_at_once_with_that_delay(
    server: EmbeddingServer,
) -> None:
    server.fail_next(Answer(429, {"Retry-After": "120"}, {"error": {"message": "quota"}}))
    with pytest.raises(EmbeddingUnavailable) as caught:
        await client(server, embedding_retry_seconds=5.0).aembed(["one"])
    assert len(server.requests) == 1
    assert caught.value.delay == 120.0  # the task waits what the server asked for


async def test_a_refused_connection_is_retried_until_the_server_is_back(server: EmbeddingServer) -> None:
    server.stop()
    restart = threading.Timer(1.0, server.start)
    restart.start()
    before = retries("connection")
    try:
        vectors = await client(server, embedding_backoff_seconds=0.2).aembed(["back again"])
    finally:
        restart.join()
    assert unit(vectors[0])
    assert retries("connection") - before >= 2


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (Answer(400, body={"error": {"message": "input is too long: 9000 tokens > 512"}}), "9000 tokens"),
        (Answer(401, body={"error": "Invalid API key", "error_type": "auth"}), "Invalid API key"),
        (Answer(422, body={"detail": [{"msg": "field required"}]}), "field required"),
        (Answer(404, body=b"<html>\n<h1>no such route</h1>\n</html>"), "no such route"),
    ],
)
async def test_a_permanent_answer_is_rejected_at_once_with_the_servers_message_on_one_line(
    server: EmbeddingServer, answer: Answer, expected: str
) -> None:
    server.fail_next(answer)
    with pytest.raises(EmbeddingRejected) as caught:
        await client(server).aembed(["one"])
    assert len(server.requests) == 1
    message = str(caught.value)
    assert expected in message and f"answered {answer.status}" in message and "\n" not in message
    assert not isinstance(caught.value, StoreUnavailable | RetryableError)


async def test_an_unknown_model_is_rejected(server: EmbeddingServer) -> None:
    with pytest.raises(EmbeddingRejected, match="model 'other' not found"):
        await client(server, embedding_model="other").aembed(["one"])


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"<html>a proxy's page</html>", "no embeddings list"),
        ({"object": "list", "data": [{"index": 0}]}, "no embeddings list"),
        ({"data": [{"index": 0, "embedding": ["x"]}]}, "no embeddings list"),
        ({"data": []}, "returned 0 vectors for 1 texts"),
    ],
)
async def test_a_malformed_answer_is_rejected(server: EmbeddingServer, body: Any, expected: str) -> None:
    server.fail_next(Answer(200, body=body))
    with pytest.raises(EmbeddingRejected, match=expected):
        await client(server).aembed(["one"])


async def test_vectors_of_another_dimension_are_rejected(server: EmbeddingServer) -> None:
    server.dimension_override = 32
    with pytest.raises(EmbeddingRejected, match=r"32 dimensions.*DTASK_EMBEDDING_DIMENSION says 64"):
        await client(server).aembed(["one"])


async def test_texts_go_out_in_batches_of_the_setting_and_come_back_in_order(server: EmbeddingServer) -> None:
    texts = [f"text number {i}" for i in range(10)]
    vectors = await client(server, embedding_batch=4).aembed(texts)
    assert sorted(len(r.texts) for r in server.requests) == [2, 4, 4]
    for got, want in zip(vectors, HashingEmbedder(DIM).embed(texts), strict=True):
        assert got == pytest.approx(want, abs=1e-9)


async def test_requests_in_flight_are_bounded_by_the_concurrency_setting(server: EmbeddingServer) -> None:
    server.delay = 0.2
    embedder = client(server, embedding_batch=1, embedding_concurrency=2)
    await asyncio.gather(embedder.aembed([f"a{i}" for i in range(4)]), embedder.aembed(["b0", "b1"]))
    assert len(server.requests) == 6
    assert server.most_in_flight == 2


def test_the_dimension_is_probed_once_with_one_text(server: EmbeddingServer) -> None:
    embedder = client(server, embedding_dimension=None)  # asks at once, in its own loop
    assert embedder.dimension == DIM
    assert embedder.dimension == DIM
    assert [len(r.texts) for r in server.requests] == [1]


def test_a_probe_that_failed_while_the_server_was_away_is_asked_again(server: EmbeddingServer) -> None:
    server.stop()
    embedder = client(server, embedding_dimension=None)
    time.sleep(0.3)  # the early probe meets a closed port
    server.start()
    assert embedder.dimension == DIM
    assert [len(r.texts) for r in server.requests] == [1]


def test_a_probe_that_cannot_reach_the_server_is_unavailable(server: EmbeddingServer) -> None:
    server.stop()
    embedder = client(server, embedding_dimension=None)
    with pytest.raises(EmbeddingUnavailable, match="not retried"):
        _ = embedder.dimension


def test_the_synchronous_embed_runs_the_client_in_its_own_loop(server: EmbeddingServer) -> None:
    embedder = client(server)
    results: list[list[list[float]]] = []
    threads = [threading.Thread(target=lambda: results.append(embedder.embed(["x", "y"]))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and all(unit(v) for r in results for v in r)


async def test_the_api_key_is_sent_as_a_bearer_token_only_when_set(server: EmbeddingServer) -> None:
    await client(server, embedding_api_key="sk-test-key").aembed(["one"])
    await client(server).aembed(["two"])
    assert server.requests[0].headers["authorization"] == "Bearer sk-test-key"
    assert "authorization" not in server.requests[1].headers


async def test_a_cancel_stops_the_retries_at_once(server: EmbeddingServer) -> None:
    # The runtime cancels the handler when its lease is lost (or on cancel / timeout).
    server.fail_every(1, Answer(503))
    call = asyncio.create_task(
        client(server, embedding_backoff_seconds=0.2, embedding_retry_seconds=60).aembed(["x"])
    )
    await asyncio.sleep(0.8)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    seen = len(server.requests)
    await asyncio.sleep(1.0)
    assert seen >= 2 and len(server.requests) == seen


def test_load_embedder_openai_reads_the_settings_and_names_the_model(
    server: EmbeddingServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DTASK_EMBEDDING_URL", server.url + "/")
    monkeypatch.setenv("DTASK_EMBEDDING_MODEL", server.model)
    monkeypatch.delenv("DTASK_EMBEDDING_DIMENSION", raising=False)
    server.stop()
    # The Embedder check does not read the (probing) dimension: loading works with the server away.
    embedder = load_embedder("openai")
    assert embedder.name == f"openai:{server.model}"
    server.start()
    assert embedder.dimension == DIM


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"DTASK_EMBEDDING_MODEL": "m"}, "needs DTASK_EMBEDDING_URL"),
        ({"DTASK_EMBEDDING_URL": "http://127.0.0.1:1/v1"}, "needs DTASK_EMBEDDING_MODEL"),
        (
            {"DTASK_EMBEDDING_URL": "http://127.0.0.1:1/v1/embeddings", "DTASK_EMBEDDING_MODEL": "m"},
            "base URL",
        ),
        ({"DTASK_EMBEDDING_URL": "127.0.0.1:1/v1", "DTASK_EMBEDDING_MODEL": "m"}, "http:// or https://"),
    ],
)
def test_bad_settings_are_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: str
) -> None:
    for name in ("DTASK_EMBEDDING_URL", "DTASK_EMBEDDING_MODEL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=expected):
        load_embedder("openai")


def test_a_base_built_with_another_model_is_refused_in_one_line_naming_the_setting(
    server: EmbeddingServer,
) -> None:
    embedder = client(server)
    assert mismatch(embedder, f"openai:{server.model}", DIM) is None
    assert mismatch(embedder, "openai:bge-small-en", 384, who="this worker") == (
        "the base was built with embedder openai:bge-small-en (384 dimensions); this worker embeds with "
        f"openai:{server.model} ({DIM} dimensions): set DTASK_EMBEDDER=openai and "
        "DTASK_EMBEDDING_MODEL=bge-small-en"
    )
    assert str(mismatch(embedder, "hashing-1024", 1024)).endswith("set DTASK_EMBEDDER to match")
    assert "another size" in str(mismatch(embedder, f"openai:{server.model}", 32))
