"""Slow clients against a real `dtask api` process over raw sockets: a client that is slow to send
its headers, or stalls in its body (read, or discarded after an early answer), is disconnected by
the server within its timeout, while normal requests go on answering; past
DTASK_API_LIMIT_CONCURRENCY connections, requests get 503."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.live_api import api_process

SECRET = "slow-clients-secret-0123456789"
HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 2.0
# How late after its timeout a connection may still be closed: the machine is shared and busy.
MARGIN = 8.0
CLIENTS = 50


@pytest.fixture(scope="module")
def api() -> Iterator[str]:
    with api_process(
        DTASK_API_KEYS=f"slow:{SECRET}",
        DTASK_API_HEADER_TIMEOUT_SECONDS=str(HEADER_TIMEOUT),
        DTASK_API_BODY_TIMEOUT_SECONDS=str(BODY_TIMEOUT),
        DTASK_API_LIMIT_CONCURRENCY="1000",
    ) as (url, _proc):
        yield url


class Client:
    """One raw connection that sends a byte every ``every`` seconds, and notices when the server
    closes it."""

    def __init__(self, port: int, first: bytes, every: float) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(first)
        self.sock.setblocking(False)
        self.opened = self.sent = time.monotonic()
        self.every = every
        self.closed_after: float | None = None
        self.answer = b""

    def poll(self) -> None:
        if self.closed_after is not None:
            return
        try:
            while data := self.sock.recv(65536):
                self.answer += data
        except BlockingIOError:  # nothing more to read, still open
            if time.monotonic() - self.sent < self.every:
                return
            try:
                self.sock.send(b"a")
                self.sent = time.monotonic()
                return
            except (BrokenPipeError, ConnectionResetError):
                pass
        except ConnectionResetError:
            pass
        self.closed_after = time.monotonic() - self.opened
        self.sock.close()


def _poll_until_closed(clients: list[Client], within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(c.closed_after is None for c in clients):
        for client in clients:
            client.poll()
        time.sleep(0.05)
    for client in clients:
        if client.closed_after is None:
            client.sock.close()


def test_slow_headers_and_stalled_bodies_are_cut_off_while_normal_requests_answer(api: str) -> None:
    port = int(api.rsplit(":", 1)[1])
    # Headers trickled a byte per 0.5 s (each well inside uvicorn's keep-alive timeout) and never
    # finished; bodies that stop after their first byte, then come a byte per 3 s.
    partial = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: "
    slow_headers = [Client(port, partial, 0.5) for _ in range(CLIENTS)]
    head = (
        f"POST /tasks HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
    ).encode()
    slow_bodies = [Client(port, head, 3.0) for _ in range(CLIENTS)]
    # The same without a key: answered 401 at once, then the rest of the body is awaited (so a
    # client that sends all of it before reading still reads the answer), a piece at a time.
    unread = head.replace(f"Authorization: Bearer {SECRET}\r\n".encode(), b"")
    answered_early = [Client(port, unread, 3.0) for _ in range(CLIENTS)]

    # Meanwhile the api answers everyone else.
    assert httpx.get(f"{api}/healthz", timeout=10).status_code == 200
    r = httpx.post(
        f"{api}/tasks", json={"task_type": "nope"}, headers={"Authorization": f"Bearer {SECRET}"}, timeout=10
    )
    assert r.status_code == 422, r.text

    everyone = slow_headers + slow_bodies + answered_early
    _poll_until_closed(everyone, max(HEADER_TIMEOUT, BODY_TIMEOUT) + MARGIN)
    for kind, clients, timeout, answer in (
        ("slow-header", slow_headers, HEADER_TIMEOUT, b""),
        ("stalled-body", slow_bodies, BODY_TIMEOUT, b"HTTP/1.1 408"),
        ("answered-early", answered_early, BODY_TIMEOUT, b"HTTP/1.1 401"),
    ):
        still_open = sum(c.closed_after is None for c in clients)
        assert not still_open, f"{still_open} {kind} connections still open after {timeout + MARGIN} s"
        # Closed by the timeout, not before it.
        assert min(c.closed_after or 0 for c in clients) >= timeout * 0.9, kind
        assert all(c.answer.startswith(answer) for c in clients), (kind, clients[0].answer[:200])
    assert httpx.get(f"{api}/healthz", timeout=10).status_code == 200


def test_past_the_concurrency_limit_requests_get_503_until_silent_connections_are_closed() -> None:
    limit, header_timeout = 20, 5.0
    with api_process(
        DTASK_API_KEYS=f"slow:{SECRET}",
        DTASK_API_HEADER_TIMEOUT_SECONDS=str(header_timeout),
        DTASK_API_LIMIT_CONCURRENCY=str(limit),
    ) as (url, _proc):
        port = int(url.rsplit(":", 1)[1])
        silent = [Client(port, b"", every=float("inf")) for _ in range(limit)]
        # Once the server has taken them all in (nothing here can tell when), it refuses the rest.
        deadline = time.monotonic() + header_timeout / 2
        while (status := httpx.get(f"{url}/healthz", timeout=10).status_code) != 503:
            assert time.monotonic() < deadline, status
            time.sleep(0.1)
        _poll_until_closed(silent, header_timeout + MARGIN)
        assert all(c.closed_after is not None for c in silent)
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
