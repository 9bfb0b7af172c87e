"""``DTASK_EMBEDDER=openai``: vectors from a server of the OpenAI-compatible ``/v1/embeddings`` API.

vLLM, Ollama, TEI, infinity and hosted providers all serve it. Texts go out
``DTASK_EMBEDDING_BATCH`` per request, at most ``DTASK_EMBEDDING_CONCURRENCY`` requests in flight
per event loop (a worker process runs one); the vectors come back L2-normalised, so cosine
similarity is their inner product whatever the server's own convention.

Failures are classified where they happen, inside the attempt:

- 408, 429, 5xx, a timeout or a refused connection is retried with exponential backoff and jitter
  (or after the server's ``Retry-After``) for up to ``DTASK_EMBEDDING_RETRY_SECONDS``; the runtime
  renews the lease meanwhile, and a lost lease or a cancel cancels the wait. Past the budget,
  ``EmbeddingUnavailable``: a ``StoreUnavailable`` (so the ingest handler hands the task back to
  pending with backoff) that is also a ``RetryableError`` (so a caller outside a store step is
  retried the same way) — and a 503 from the api's routes.
- Any other answer (400, 401, 404, ...), vectors of the wrong dimension or count, or a body that is
  not the API's JSON is ``EmbeddingRejected``: permanent, with the server's own message on one line.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import os
import random
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from weakref import WeakKeyDictionary

import httpx

from domains.http_answers import retry_after_seconds, server_message
from domains.knowledge.errors import EmbeddingRejected, StoreUnavailable
from domains.knowledge.model_metrics import EMBEDDING_FAILURES, EMBEDDING_RETRIES
from domains.knowledge.model_settings import EmbeddingSettings
from tasks_core.retry import RetryableError, jittered

T = TypeVar("T")
# Statuses another try may not meet: timeout, rate limit, and the server's own failures.
RETRY_STATUSES = frozenset({408, 429}) | frozenset(range(500, 600))
# The longest wait between two retries (Retry-After aside): an outage is re-checked this often.
MAX_BACKOFF_SECONDS = 10.0
# How much of the server's error body goes into a message.
MESSAGE_CHARS = 300


class EmbeddingUnavailable(StoreUnavailable, RetryableError):
    """The endpoint stayed unreachable or overloaded past the retry budget: worth a later attempt.
    ``delay`` is the server's last Retry-After, if it gave one."""

    def __init__(self, message: str, *, delay: float | None = None) -> None:
        Exception.__init__(self, message[:500])
        self.service = "the embedding endpoint"
        self.code = "embedding_unavailable"
        self.delay = delay


def normalise(vector: list[float]) -> list[float]:
    norm = math.sqrt(math.fsum(v * v for v in vector))
    return [v / norm for v in vector] if norm else vector


@dataclass
class _LoopState:
    """What belongs to one event loop: an httpx client and the bound on requests in flight."""

    client: httpx.AsyncClient
    bound: asyncio.Semaphore


class _OwnLoop:
    """A private event loop in a daemon thread, for the synchronous ``embed`` (the bench's plain
    pipeline, a script): the async client runs there whatever the caller's thread is."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid = 0

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():  # a forked child needs its own thread
                self._loop, self._pid = asyncio.new_event_loop(), os.getpid()
                threading.Thread(target=self._loop.run_forever, name="openai-embedder", daemon=True).start()
            loop = self._loop
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.submit(coro).result()


class OpenAIEmbedder:
    """An ``Embedder`` (``name``, ``dimension``, ``embed``) with the ``aembed`` coroutine that
    ``embedding.embed_texts`` awaits."""

    def __init__(self, settings: EmbeddingSettings) -> None:
        if not settings.embedding_url or not settings.embedding_model:
            missing = [
                name
                for name, value in (
                    ("DTASK_EMBEDDING_URL", settings.embedding_url),
                    ("DTASK_EMBEDDING_MODEL", settings.embedding_model),
                )
                if not value
            ]
            raise ValueError(
                f"DTASK_EMBEDDER=openai needs {' and '.join(missing)} "
                "(the server's base URL ending in /v1, and the model it serves)"
            )
        self.settings = settings
        self.model = settings.embedding_model
        self.name = f"openai:{self.model}"
        self.endpoint = f"{settings.embedding_url}/embeddings"
        self._dimension = settings.embedding_dimension
        key = settings.embedding_api_key.get_secret_value() if settings.embedding_api_key else ""
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._loops: WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = WeakKeyDictionary()
        self._own = _OwnLoop()
        self._rng = random.Random()
        # Without a configured dimension the server is asked at once, in the embedder's own loop,
        # so that by the time a caller on an event loop reads ``dimension`` (after reading and
        # parsing a file) the answer is usually there and that loop is not held.
        self._early_probe = None if self._dimension is not None else self._own.submit(self.probe(retry=False))

    # ------------------------------------------------------------------ the Embedder protocol

    @property
    def dimension(self) -> int:
        """DTASK_EMBEDDING_DIMENSION, else what the server answered (asked with one text in the
        embedder's own loop when it was made, and again here if that failed: one request, no
        retries, so a caller on an event loop is held for at most one request timeout)."""
        if self._dimension is None:
            early, self._early_probe = self._early_probe, None
            if early is not None:
                with contextlib.suppress(Exception):  # the server may be back: asked again below
                    early.result()
            if self._dimension is None:
                self._own.run(self.probe(retry=False))
        assert self._dimension is not None
        return self._dimension

    async def probe(self, *, retry: bool = True) -> int:
        """The vectors' dimension, asking the server (one text) if it is not known yet."""
        if self._dimension is None:
            await self._request(["dimension probe"], retry=retry)
        assert self._dimension is not None
        return self._dimension

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """The synchronous form (for callers with no event loop of their own)."""
        return self._own.run(self.aembed(texts))

    async def aembed(self, texts: Sequence[str]) -> list[list[float]]:
        if not texts:
            return []
        size = self.settings.embedding_batch
        batches = [list(texts[i : i + size]) for i in range(0, len(texts), size)]
        if len(batches) == 1:
            return await self._request(batches[0])
        # A failing batch cancels its siblings: the call fails as one.
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(self._request(batch)) for batch in batches]
        return [vector for task in tasks for vector in task.result()]

    async def aclose(self) -> None:
        """Close this loop's client (tests; a process closes them when it exits)."""
        state = self._loops.pop(asyncio.get_running_loop(), None)
        if state is not None:
            await state.client.aclose()

    # ------------------------------------------------------------------ one request, retried

    async def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        state = self._loops.get(loop)
        if state is None:
            concurrency = self.settings.embedding_concurrency
            # Built in a thread: loading the TLS trust store takes 0.1-0.3 s, too long to hold a
            # worker's loop (every heartbeat of the process waits on it).
            client = await asyncio.to_thread(
                httpx.AsyncClient,
                timeout=self.settings.embedding_timeout_seconds,
                headers=self._headers,
                limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
            )
            state = self._loops.get(loop)  # another call may have built one meanwhile
            if state is None:
                state = self._loops[loop] = _LoopState(client, asyncio.Semaphore(concurrency))
            else:
                await client.aclose()
        return state

    def _backoff(self, retry: int) -> float:
        return jittered(self.settings.embedding_backoff_seconds, retry, MAX_BACKOFF_SECONDS, self._rng.random)

    async def _request(self, texts: list[str], *, retry: bool = True) -> list[list[float]]:
        state = await self._state()
        body = {"model": self.model, "input": texts, "encoding_format": "float"}
        budget = self.settings.embedding_retry_seconds if retry else 0.0
        first_failure: float | None = None
        retries = 0
        while True:
            retry_after: float | None = None
            try:
                async with state.bound:
                    response = await state.client.post(self.endpoint, json=body)
            except httpx.TimeoutException as exc:
                reason, why = (
                    "timeout",
                    f"no answer within {self.settings.embedding_timeout_seconds:g} s ({type(exc).__name__})",
                )
            except httpx.TransportError as exc:
                reason, why = "connection", f"{type(exc).__name__}: {exc}".rstrip(": ")
            else:
                if response.status_code == 200:
                    return self._vectors(response, len(texts))
                if response.status_code not in RETRY_STATUSES:
                    EMBEDDING_FAILURES.labels(kind="rejected").inc()
                    raise EmbeddingRejected(
                        f"the embedding endpoint {self.endpoint} answered {response.status_code} "
                        f"for model {self.model}: {server_message(response)}"
                    )
                reason = str(response.status_code)
                why = f"{response.status_code} {server_message(response)}"
                retry_after = retry_after_seconds(response.headers.get("retry-after"))
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            retries += 1
            # A Retry-After of 0 still gets a breath: the loop must not spin on a server saying "now".
            wait = max(retry_after, 0.1) if retry_after is not None else self._backoff(retries)
            if now + wait > first_failure + budget:
                EMBEDDING_FAILURES.labels(kind="unavailable").inc()
                tried = (
                    f"after {retries - 1} retries in {now - first_failure:.0f} s"
                    if retries > 1
                    else "(not retried)"
                )
                raise EmbeddingUnavailable(
                    f"the embedding endpoint {self.endpoint} is unavailable {tried}: {why}", delay=retry_after
                )
            EMBEDDING_RETRIES.labels(reason=reason).inc()
            await asyncio.sleep(wait)  # a lost lease or a cancel cancels the handler here

    def _vectors(self, response: httpx.Response, count: int) -> list[list[float]]:
        """The answer's vectors in input order, checked (count, numbers, dimension) and normalised."""
        where = f"the embedding endpoint {self.endpoint}"
        try:
            data = response.json()["data"]
            ordered = sorted(data, key=lambda item: int(item["index"]))
            vectors = [[float(v) for v in item["embedding"]] for item in ordered]
        except (ValueError, KeyError, TypeError) as exc:
            EMBEDDING_FAILURES.labels(kind="rejected").inc()
            snippet = " ".join(response.text.split())[:120]
            raise EmbeddingRejected(
                f"{where} answered 200 with no embeddings list ({type(exc).__name__}: {exc}): {snippet!r}"
            ) from exc
        if len(vectors) != count:
            EMBEDDING_FAILURES.labels(kind="rejected").inc()
            raise EmbeddingRejected(f"{where} returned {len(vectors)} vectors for {count} texts")
        sizes = {len(v) for v in vectors}
        if self._dimension is None and len(sizes) == 1:
            self._dimension = sizes.pop()
            sizes = {self._dimension}
        if sizes != {self._dimension} or not all(math.isfinite(x) for v in vectors for x in v):
            EMBEDDING_FAILURES.labels(kind="rejected").inc()
            source = "DTASK_EMBEDDING_DIMENSION" if self.settings.embedding_dimension else "its first answer"
            got = ", ".join(str(s) for s in sorted(sizes))
            raise EmbeddingRejected(
                f"{where} returned vectors of {got} dimensions (or not finite) for model {self.model}; "
                f"{source} says {self._dimension}"
            )
        return [normalise(v) for v in vectors]


def from_settings() -> OpenAIEmbedder:
    """The client the DTASK_EMBEDDING_* settings describe (``load_embedder("openai")``)."""
    return OpenAIEmbedder(EmbeddingSettings())
