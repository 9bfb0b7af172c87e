"""A scripted OpenAI-compatible chat endpoint on a free 127.0.0.1 port, for the language-model client's
tests: it answers each POST /v1/chat/completions with the next reply of its script (a status, a body,
headers, an optional delay) or with what a responder function makes of the request, and records
every request (body and headers) and the most requests it held at once."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Reply:
    status: int = 200
    body: Any = None  # a dict or list is sent as JSON, a str as it is
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0


def completion(content: str | None, finish_reason: str = "stop", model: str = "test-model") -> Reply:
    """A 200 with one choice whose message holds ``content``."""
    return Reply(
        body={
            "id": "chatcmpl-test",
            "object": "chat.completion",
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": finish_reason,
                }
            ],
        }
    )


@dataclass
class Seen:
    body: dict[str, Any]
    headers: dict[str, str]
    at: float

    @property
    def prompt(self) -> str:
        return str(self.body["messages"][0]["content"])


class ScriptedEndpoint:
    def __init__(self, script: Sequence[Reply] | Callable[[Seen], Reply]) -> None:
        self.script = script
        self.seen: list[Seen] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def _next(self, seen: Seen) -> Reply:
        with self._lock:
            self.seen.append(seen)
            index = len(self.seen) - 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        if callable(self.script):
            return self.script(seen)
        script = list(self.script)
        return script[min(index, len(script) - 1)]  # the last reply repeats

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                raw = self.rfile.read(length)
                try:
                    if self.path != "/v1/chat/completions":
                        reply = Reply(404, {"detail": f"no route {self.path}"})
                        with endpoint._lock:
                            endpoint.in_flight += 1
                    else:
                        seen = Seen(
                            json.loads(raw), {k.lower(): v for k, v in self.headers.items()}, time.monotonic()
                        )
                        reply = endpoint._next(seen)
                    if reply.delay:
                        time.sleep(reply.delay)
                    body = reply.body
                    data = (json.dumps(body) if isinstance(body, (dict, list)) else str(body or "")).encode()
                    self.send_response(reply.status)
                    kind = "application/json" if isinstance(body, (dict, list)) else "text/plain"
                    self.send_header("Content-Type", kind)
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                finally:
                    with endpoint._lock:
                        endpoint.in_flight -= 1

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler

    @contextmanager
    def running(self) -> Iterator[ScriptedEndpoint]:
        thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        thread.start()
        try:
            yield self
        finally:
            self._server.shutdown()
            self._server.server_close()
            thread.join(5)


def passage(prompt: str) -> str:
    """The text a shipped prompt quotes between its triple quotes."""
    return prompt.split('"""\n', 1)[1].rsplit('\n"""', 1)[0]
