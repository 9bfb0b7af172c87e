"""Request bodies against a real `dtask api` process: no key → 401 before the body is read;
an over-limit body (declared or chunked) → 413, and only the upload route has the upload limit.

The no-key 32 MiB upload is measured (time to 401, the server's peak memory) and reported, not
asserted: the machine is noisy, and the protocol only promises the 401.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.live_api import api_process, peak_rss_mb

SECRET = "limits-secret-0123456789"
LIMIT = 1024 * 1024
MB = 1024 * 1024


@pytest.fixture(scope="module")
def api() -> Iterator[tuple[int, int]]:
    with api_process(DTASK_API_KEYS=f"limits:{SECRET}", DTASK_MAX_REQUEST_BYTES=str(LIMIT)) as (url, proc):
        yield int(url.rsplit(":", 1)[1]), proc.pid


def _send(port: int, head: bytes, chunks: Iterator[bytes]) -> tuple[int, float, int]:
    """Send a request, stop sending as soon as the server answers.

    Returns (status, seconds to the answer, body bytes sent before it came)."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        started = time.monotonic()
        sock.sendall(head)
        for chunk in chunks:
            if select.select([sock], [], [], 0)[0]:
                break  # answered before we finished: it did not wait for the body
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
        answer = sock.recv(4096)
        return int(answer.split()[1]), time.monotonic() - started, sent


def test_a_huge_body_without_a_key_is_refused_unread(api: tuple[int, int], record_property: object) -> None:
    port, pid = api
    size = 32 * 1024 * 1024
    head = (
        f"POST /tasks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
    ).encode()
    before = peak_rss_mb(pid)
    status, seconds, sent = _send(port, head, (b"x" * 65536 for _ in range(size // 65536)))
    after = peak_rss_mb(pid)
    assert status == 401
    # Answered while most of the body was still unsent (what was sent sat in socket buffers): an
    # api that read the body before checking the key could not have answered yet.
    assert sent < size // 2, sent
    print(
        f"no-key 32 MiB body: 401 after {seconds * 1000:.1f} ms; api peak RSS {before:.0f} -> {after:.0f} MB"
    )
    record_property("no_key_32mib_ms", round(seconds * 1000, 1))  # type: ignore[operator]
    record_property("api_peak_rss_growth_mb", round(after - before, 1))  # type: ignore[operator]


def test_an_over_limit_chunked_body_is_413(api: tuple[int, int]) -> None:
    port, _ = api
    head = (
        f"POST /tasks HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    piece = b"x" * 65536
    frames = (b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(2 * LIMIT // len(piece)))
    status, _, _ = _send(port, head, frames)
    assert status == 413


def test_an_over_limit_declared_body_is_413_and_a_fitting_one_is_read(api: tuple[int, int]) -> None:
    port, _ = api
    auth = {"Authorization": f"Bearer {SECRET}"}
    r = httpx.post(f"http://127.0.0.1:{port}/tasks", content=b"x" * (LIMIT + 1), headers=auth)
    assert r.status_code == 413
    r = httpx.post(
        f"http://127.0.0.1:{port}/tasks", json={"task_type": "diagnostics.noop"}, headers=auth, timeout=10
    )
    assert r.status_code in (202, 403), r.text  # read and handled (diagnostics may be admin-only)


def test_only_the_upload_route_takes_upload_sized_bodies(api: tuple[int, int]) -> None:
    """The upload limit is the multipart upload route's alone: a 30 MiB JSON body to a search (or
    to any other route, under /knowledge or not) is refused long before it is all sent: 413,
    declared or chunked (a chunked body to a route that never reads one gets that route's answer)."""
    port, _ = api
    base = "0" * 32
    auth = f"Authorization: Bearer {SECRET}\r\n"
    piece = b"x" * 65536
    big = 30 * MB
    for method, path, chunked_status in (
        ("POST", f"/knowledge/bases/{base}/search", 413),
        ("POST", "/knowledge/bases", 413),
        ("PUT", f"/knowledge/bases/{base}/files", 405),
        ("POST", f"/knowledge/bases/{base}/files/more", 404),
    ):
        head = f"{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
        declared = f"{head}Content-Length: {big}\r\n\r\n".encode()
        status, _, sent = _send(port, declared, (piece for _ in range(big // len(piece))))
        assert (status, path) == (413, path) and sent < big // 2, sent
        chunked = f"{head}Transfer-Encoding: chunked\r\n\r\n".encode()
        frames = (b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(big // len(piece)))
        status, _, sent = _send(port, chunked, frames)
        assert (status, path) == (chunked_status, path) and sent < big // 2, sent
    # The upload route itself still takes a body over DTASK_MAX_REQUEST_BYTES: past the limit it
    # answers 503 naming the stores (none configured) or, with the session's stores, 404 (no base).
    r = httpx.post(
        f"http://127.0.0.1:{port}/knowledge/bases/{base}/files",
        files={"files": ("a.txt", b"y" * (2 * LIMIT), "text/plain")},
        headers={"Authorization": f"Bearer {SECRET}"},
        timeout=30,
    )
    assert r.status_code in (404, 503), r.text


def test_a_client_that_sends_its_whole_body_before_reading_gets_the_answer(api: tuple[int, int]) -> None:
    """Refused before its body is read (here 401), a client that finishes sending before it
    reads, as most do, still reads the answer: the server discards the rest of the body as it
    comes rather than resetting the connection under it."""
    port, _ = api
    size = 16 * MB
    head = f"POST /tasks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {size}\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"{head}\r\n".encode())
        piece = b"x" * 65536
        for _ in range(size // len(piece)):
            sock.sendall(piece)
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
