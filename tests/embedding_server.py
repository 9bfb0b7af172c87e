"""A real OpenAI-compatible ``/v1/embeddings`` server for the embedding client's tests, on a free
127.0.0.1 port, in a thread of the test process: it answers with the hashing embedder's vectors
(scaled by ``SCALE``, so only a client that normalises gets unit vectors), and fails on request —
a scripted sequence of answers (``fail_next``), a failure every n-th request (``fail_every``), or
not at all while it is down (``stop`` closes the port; ``start`` opens the same port again).
Every request is recorded (its texts, headers and time)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from domains.knowledge.hashing import HashingEmbedder

SCALE = 3.0


@dataclass
class Answer:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: Any = None  # JSON value, or bytes sent as they are


@dataclass
class Seen:
    texts: list[str]
    headers: dict[str, str]
    at: float
    status: int = 0


class EmbeddingServer:
    def __init__(self, dimension: int = 64, model: str = "test-model") -> None:
        self.embedder = HashingEmbedder(dimension)
        self.model = model
        self.port = _free_port()
        self.requests: list[Seen] = []
        self._script: list[Answer] = []
        self._every: list[tuple[int, Answer]] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()
        self.dimension_override: int | None = None  # answer vectors of this size instead
        self.delay = 0.0  # seconds each request takes
        self.in_flight = self.most_in_flight = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    # ------------------------------------------------------------------ control

    def start(self) -> EmbeddingServer:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def setup(self) -> None:
                super().setup()
                with outer._lock:
                    outer._connections.add(self.connection)

            def finish(self) -> None:
                with outer._lock:
                    outer._connections.discard(self.connection)
                super().finish()

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", 0))
                raw = self.rfile.read(length)
                with outer._lock:
                    outer.in_flight += 1
                    outer.most_in_flight = max(outer.most_in_flight, outer.in_flight)
                try:
                    time.sleep(outer.delay)
                    answer = outer._answer(self.path, raw, dict(self.headers))
                finally:
                    with outer._lock:
                        outer.in_flight -= 1
                payload = answer.body if isinstance(answer.body, bytes) else json.dumps(answer.body).encode()
                self.send_response(answer.status)
                for key, value in {"content-type": "application/json", **answer.headers}.items():
                    self.send_header(key, value)
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Fully down until ``start``: the port refuses connections, and the kept-alive ones are cut."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            cut, self._connections = list(self._connections), set()
        for conn in cut:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def fail_next(self, *answers: Answer) -> None:
        with self._lock:
            self._script.extend(answers)

    def fail_every(self, n: int, answer: Answer) -> None:
        """Answer every n-th request so (the first rule that matches wins)."""
        with self._lock:
            self._every.append((n, answer))

    def ok_count(self) -> int:
        return sum(1 for r in self.requests if r.status == 200)

    # ------------------------------------------------------------------ answers

    def _answer(self, path: str, raw: bytes, headers: dict[str, str]) -> Answer:
        try:
            body = json.loads(raw)
            texts = list(body["input"]) if isinstance(body["input"], list) else [body["input"]]
        except (ValueError, KeyError, TypeError):
            body, texts = {}, []
        seen = Seen(texts, {k.lower(): v for k, v in headers.items()}, time.monotonic())
        with self._lock:
            self.requests.append(seen)
            n = len(self.requests)
            every = [answer for k, answer in self._every if n % k == 0]
            if self._script:
                answer = self._script.pop(0)
            elif every:
                answer = every[0]
            else:
                answer = self._vectors(path, body, texts)
        seen.status = answer.status
        return answer

    def _vectors(self, path: str, body: dict[str, Any], texts: list[str]) -> Answer:
        if path != "/v1/embeddings":
            return Answer(404, body={"detail": "Not Found"})
        if body.get("model") != self.model:
            return Answer(404, body={"error": {"message": f"model {body.get('model')!r} not found"}})
        if not texts:
            return Answer(400, body={"error": {"message": "input must not be empty"}})
        vectors = self.embedder.embed(texts)
        if self.dimension_override:
            vectors = [(v * 2)[: self.dimension_override] for v in vectors]
        # Reversed, with their indexes: the client must order them by index.
        data = [
            {"object": "embedding", "index": i, "embedding": [x * SCALE for x in v]}
            for i, v in reversed(list(enumerate(vectors)))
        ]
        return Answer(200, body={"object": "list", "model": self.model, "data": data})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
