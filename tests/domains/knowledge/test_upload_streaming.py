"""Uploads through a real `dtask api` process on real S3 (SeaweedFS): the files stream from the
client to a spool file to the bucket, so parallel large uploads cost the api a bounded amount of
memory, and the originals arrive whole."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.knowledge_helpers import ALICE, KEYS, knowledge_api, object_names, s3_client
from tests.live_api import api_process, peak_rss_mb

pytestmark = pytest.mark.usefixtures("clean_db")

MB = 1024 * 1024
FILE_BYTES = 60 * MB
PARALLEL = 8
# Before streaming, 8 parallel 60 MB uploads grew the api by 1,444 MB (each body buffered,
# copied, then read again). Streamed, each costs about a client library part buffer.
PEAK_GROWTH_BOUND_MB = 400


@pytest.fixture(scope="module")
def big_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("uploads") / "big.txt"
    line = b"the quick brown fox jumps over the lazy dog again and again\n"
    with path.open("wb") as out:
        block = line * (MB // len(line) + 1)
        written = 0
        while written < FILE_BYTES:
            piece = block[: FILE_BYTES - written]
            out.write(piece)
            written += len(piece)
    return path


async def _upload(client: httpx.AsyncClient, base: str, path: Path) -> httpx.Response:
    with path.open("rb") as f:  # httpx streams an open file in chunks
        return await client.post(
            f"/knowledge/bases/{base}/files", files={"files": (path.name, f, "text/plain")}, headers=ALICE
        )


async def test_parallel_large_uploads_stream_within_a_memory_bound(
    knowledge_stores: dict[str, str], big_file: Path, record_property: object
) -> None:
    settings = {
        "DTASK_API_KEYS": KEYS,
        "DTASK_MAX_UPLOAD_BYTES": str(64 * MB),
        "DTASK_MAX_UPLOAD_REQUEST_BYTES": str(64 * MB),
        "DTASK_MAX_CONCURRENT_UPLOADS": str(PARALLEL),
    }
    with api_process(**settings) as (url, proc):
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            r = await client.post("/knowledge/bases", json={"name": "big"}, headers=ALICE)
            assert r.status_code == 201, r.text
            base = r.json()["id"]
            before = peak_rss_mb(proc.pid)
            answers = await asyncio.gather(*(_upload(client, base, big_file) for _ in range(PARALLEL)))
            after = peak_rss_mb(proc.pid)
    assert [a.status_code for a in answers] == [202] * PARALLEL, [a.text for a in answers]
    print(f"{PARALLEL} parallel 60 MB uploads: api peak RSS {before:.0f} -> {after:.0f} MB")
    record_property("api_peak_rss_before_mb", round(before))  # type: ignore[operator]
    record_property("api_peak_rss_after_mb", round(after))  # type: ignore[operator]
    assert after - before < PEAK_GROWTH_BOUND_MB, (before, after)
    # Eight uploads of the same bytes at once are one file (the unique index on the content hash
    # decides, in the api's own transactions): the others answer with it, and their originals,
    # streamed like the first, are not kept.
    entries = [a.json()["files"][0] for a in answers]
    [file_id] = {e["id"] for e in entries}
    assert [e.get("duplicate_of") for e in entries].count(None) == 1
    assert [e.get("duplicate_of") for e in entries].count(file_id) == PARALLEL - 1
    s3 = s3_client(knowledge_stores)
    assert object_names(knowledge_stores, f"{base}/") == [f"{base}/{file_id}"]
    stat = s3.stat_object(knowledge_stores["DTASK_MINIO_BUCKET"], f"{base}/{file_id}")
    assert stat.size == FILE_BYTES
    # The hash was taken from the bytes as they streamed to the bucket.
    digest = hashlib.sha256()
    with big_file.open("rb") as f:
        while block := f.read(MB):
            digest.update(block)
    async with knowledge_api() as (client, _svc):
        shown = (await client.get(f"/knowledge/files/{file_id}", headers=ALICE)).json()
    assert shown["content_hash"] == digest.hexdigest() and shown["size_bytes"] == FILE_BYTES


BOUNDARY = "dtask-test-boundary"
ALICE_HEADER = f"Authorization: {ALICE['Authorization']}\r\n"


def _multipart(name: str, data: bytes) -> bytes:
    return (
        f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"files\"; filename=\"{name}\"\r\n"
        f"Content-Type: text/plain\r\n\r\n"
    ).encode() + data + f"\r\n--{BOUNDARY}--\r\n".encode()


def _upload_head(base: str, length: int | None, expect_continue: bool = False) -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (
        f"POST /knowledge/bases/{base}/files HTTP/1.1\r\nHost: x\r\n{ALICE_HEADER}"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n{framing}\r\nConnection: close\r\n"
        + ("Expect: 100-continue\r\n" if expect_continue else "")
        + "\r\n"
    ).encode()


def _read_answer(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (every request here says
    `Connection: close`, or is answered before its body is all sent)."""
    answer = b""
    try:
        while chunk := sock.recv(65536):
            answer += chunk
    except ConnectionResetError:
        pass  # closed with part of our body unread: what it said before is kept
    return answer


async def test_an_upload_over_the_bound_waits_then_gets_503_unread(knowledge_stores: dict[str, str]) -> None:
    settings = {"DTASK_API_KEYS": KEYS, "DTASK_MAX_CONCURRENT_UPLOADS": "1", "DTASK_UPLOAD_WAIT_SECONDS": "1"}
    with api_process(**settings) as (url, _proc):
        port = int(url.rsplit(":", 1)[1])
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            r = await client.post("/knowledge/bases", json={"name": "turns"}, headers=ALICE)
            base = r.json()["id"]
            body = _multipart("held.txt", b"held words " * 1000)
            with socket.create_connection(("127.0.0.1", port), timeout=30) as holder:
                # uvicorn sends 100 Continue when the app first reads the body: this upload has
                # the one turn.
                holder.sendall(_upload_head(base, len(body), expect_continue=True))
                assert holder.recv(100).startswith(b"HTTP/1.1 100 Continue")
                with socket.create_connection(("127.0.0.1", port), timeout=30) as second:
                    started = time.monotonic()
                    second.sendall(_upload_head(base, len(body), expect_continue=True))
                    answer = _read_answer(second)
                    waited = time.monotonic() - started
                # Refused after its wait, without a 100 Continue: no byte of its body was asked for.
                assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
                assert b"retry-after: 5" in answer.lower() and b"at once; try again shortly" in answer
                assert waited >= 0.9, waited
                holder.sendall(body)
                assert _read_answer(holder).startswith(b"HTTP/1.1 202"), "the held upload completes"
            # The turn is free again.
            r = await client.post(
                f"/knowledge/bases/{base}/files", files={"files": ("next.txt", b"next words")}, headers=ALICE
            )
            assert r.status_code == 202, r.text
            assert len(object_names(knowledge_stores, f"{base}/")) == 2


async def test_an_upload_over_its_limit_mid_stream_is_413_and_stores_nothing(
    knowledge_stores: dict[str, str],
) -> None:
    settings = {"DTASK_API_KEYS": KEYS, "DTASK_MAX_UPLOAD_REQUEST_BYTES": str(MB)}
    with api_process(**settings) as (url, _proc):
        port = int(url.rsplit(":", 1)[1])
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            r = await client.post("/knowledge/bases", json={"name": "over"}, headers=ALICE)
            base = r.json()["id"]
            body = _multipart("big.txt", b"z" * (3 * MB))
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(_upload_head(base, None))
                try:
                    for i in range(0, len(body), 65536):
                        piece = body[i : i + 65536]
                        sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the server answered and closed before the end
                answer = _read_answer(sock)
            assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
            assert b'"request body too large"' in answer
            assert object_names(knowledge_stores, f"{base}/") == []
            files = (await client.get(f"/knowledge/bases/{base}/files", headers=ALICE)).json()["items"]
            assert files == []
