"""Uploaded originals in an S3 bucket through the ``minio`` client (MinIO, SeaweedFS, AWS...).

One bucket per deployment (created on first use), one object per file at ``<base_id>/<file_id>``.
Every call blocks, so each runs in a thread. Deleting what is already gone succeeds.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable
from datetime import datetime
from typing import Any, BinaryIO, TypeVar

import urllib3

from domains.knowledge.calls import blocking
from domains.knowledge.errors import ObjectMissing, StoreUnavailable

T = TypeVar("T")
SERVICE = "the S3 object store"
_GONE = ("NoSuchKey", "NoSuchBucket", "NoSuchObject")
# Objects read per call while listing (an S3 listing page holds up to 1,000).
LIST_PAGE = 1000


def make_client(endpoint: str, access_key: str, secret_key: str, secure: bool, deadline: float) -> Any:
    """A ``minio.Minio`` (imported here, in the caller's thread, not at module import)."""
    from minio import Minio

    # Every request fails within about ``deadline``: a short connect, a read timeout, and a retry
    # only for a connection that failed before the request was sent (so a stalled server cannot
    # hold a caller through urllib3's retries, and nothing is sent twice). Whole operations are
    # retried by their callers: the api answers 503, an ingest goes back to pending.
    connect = min(2.0, deadline / 4)
    http = urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=connect, read=max(0.1, deadline - 2 * connect)),
        maxsize=16,
        retries=urllib3.Retry(total=1, connect=1, read=0, status=0, other=0, backoff_factor=0),
    )
    return Minio(endpoint, access_key=access_key, secret_key=secret_key, secure=secure, http_client=http)


def _reason(exc: BaseException) -> str:
    """urllib3 wraps the cause (a read timeout, a refused connection) in MaxRetryError."""
    cause = getattr(exc, "reason", None)
    return str(cause) if cause is not None else str(exc)


def _server_failed(exc: BaseException) -> bool:
    from minio.error import S3Error, ServerError

    if isinstance(exc, ServerError):
        return True
    return isinstance(exc, S3Error) and exc.code in ("InternalError", "ServiceUnavailable", "SlowDown")


def _code(exc: BaseException) -> str | None:
    """The S3 error code of a ``minio.error.S3Error`` (None for anything else)."""
    from minio.error import S3Error  # already imported by the client that raised it

    return exc.code if isinstance(exc, S3Error) else None


class HashingReader:
    """A read-only stream that hashes (sha256) and counts what is read through it."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream
        self.count = 0
        self._hash = hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self._hash.update(data)
        self.count += len(data)
        return data

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def object_key(base_id: str, file_id: str) -> str:
    return f"{base_id}/{file_id}"


class ObjectStore:
    def __init__(self, client: Any, bucket: str, deadline: float) -> None:
        self.client = client
        self.bucket = bucket
        self.deadline = deadline

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return await blocking(SERVICE, self.deadline, fn, *args, **kwargs)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise StoreUnavailable(SERVICE, f"{type(exc).__name__}: {_reason(exc)}") from exc
        except Exception as exc:
            # The server answered, but with a failure of its own (a 5xx): unavailable too. Any
            # other S3Error propagates: the caller decides what its code means.
            if _server_failed(exc):
                raise StoreUnavailable(SERVICE, str(exc)) from exc
            raise

    async def ensure_bucket(self) -> None:
        if not await self._call(self.client.bucket_exists, self.bucket):
            try:
                await self._call(self.client.make_bucket, self.bucket)
            except Exception as exc:
                if _code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):  # a racing creator
                    raise

    async def ping(self) -> None:
        await self._call(self.client.bucket_exists, self.bucket)

    async def put(self, key: str, stream: BinaryIO, length: int, content_type: str) -> str:
        """Store ``length`` bytes read from ``stream``; the sha256 (hex) of what was sent. The client
        reads and sends one part at a time (5 MiB, or a smaller file whole), one after another: a
        file's parts in parallel would hold several in memory, and an upload already sends its
        files in parallel. The hash is taken from those same reads, so no byte is read twice."""
        hashed = HashingReader(stream)
        await self._call(
            self.client.put_object,
            self.bucket,
            key,
            hashed,
            length,
            content_type=content_type,
            num_parallel_uploads=1,
        )
        if hashed.count != length:  # the client reads exactly ``length`` bytes, or fails
            raise ValueError(f"{key}: sent {hashed.count} bytes, expected {length}")
        return hashed.hexdigest()

    async def get(self, key: str) -> bytes:
        def read() -> bytes:
            response = self.client.get_object(self.bucket, key)
            try:
                data: bytes = response.read()
                return data
            finally:
                response.close()
                response.release_conn()

        try:
            return await self._call(read)
        except Exception as exc:
            if _code(exc) in _GONE:
                raise ObjectMissing(key) from exc
            raise

    async def delete(self, key: str) -> None:
        try:
            await self._call(self.client.remove_object, self.bucket, key)
        except Exception as exc:
            if _code(exc) not in _GONE:
                raise

    async def listing(self, prefix: str = "", *, recursive: bool = True) -> list[tuple[str, datetime | None]]:
        """Object names (and last-modified times) under ``prefix``; top-level "folders" (names ending
        in "/") when not ``recursive``. A page of the listing per call, so each has the deadline."""
        pages = self.client.list_objects(self.bucket, prefix=prefix, recursive=recursive)

        def page() -> list[tuple[str, datetime | None]]:
            chunk = itertools.islice(pages, LIST_PAGE)
            return [(o.object_name, o.last_modified) for o in chunk if o.object_name]

        found: list[tuple[str, datetime | None]] = []
        try:
            while batch := await self._call(page):
                found += batch
        except Exception as exc:
            if _code(exc) in _GONE:
                return []
            raise
        return found

    async def delete_prefix(self, prefix: str) -> int:
        """Remove every object under ``prefix``; how many there were (0 if the bucket is gone)."""

        def remove() -> int:
            from minio.deleteobjects import DeleteObject

            keys = [
                DeleteObject(o.object_name)
                for o in self.client.list_objects(self.bucket, prefix=prefix, recursive=True)
                if o.object_name
            ]
            for failure in self.client.remove_objects(self.bucket, keys):
                if failure.code not in _GONE:
                    raise StoreUnavailable(SERVICE, f"could not delete {failure.name}: {failure.code}")
            return len(keys)

        try:
            return await self._call(remove)
        except Exception as exc:
            if _code(exc) in _GONE:
                return 0
            raise
