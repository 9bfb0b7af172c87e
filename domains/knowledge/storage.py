"""Uploaded originals in an S3 bucket through the ``minio`` client (MinIO, SeaweedFS, AWS...).

One bucket per deployment (created on first use), one object per file at ``<base_id>/<file_id>``.
Every call blocks, so each runs in a thread. Deleting what is already gone succeeds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, BinaryIO, TypeVar

import urllib3

from domains.knowledge.errors import ObjectMissing, StoreUnavailable

T = TypeVar("T")
SERVICE = "the S3 object store"
_GONE = ("NoSuchKey", "NoSuchBucket", "NoSuchObject")


def make_client(endpoint: str, access_key: str, secret_key: str, secure: bool) -> Any:
    """A ``minio.Minio`` (imported here, in the caller's thread, not at module import)."""
    from minio import Minio

    # Short connect timeout and few retries: an unreachable store must turn into a prompt 503,
    # not a request hanging through urllib3's default back-off.
    http = urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=3, read=60),
        maxsize=16,
        retries=urllib3.Retry(total=2, connect=1, backoff_factor=0.2, status_forcelist=(500, 502, 503, 504)),
    )
    return Minio(endpoint, access_key=access_key, secret_key=secret_key, secure=secure, http_client=http)


def _code(exc: BaseException) -> str | None:
    """The S3 error code of a ``minio.error.S3Error`` (None for anything else)."""
    from minio.error import S3Error  # already imported by the client that raised it

    return exc.code if isinstance(exc, S3Error) else None


def object_key(base_id: str, file_id: str) -> str:
    return f"{base_id}/{file_id}"


class ObjectStore:
    def __init__(self, client: Any, bucket: str) -> None:
        self.client = client
        self.bucket = bucket

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise StoreUnavailable(SERVICE, f"{type(exc).__name__}: {exc}") from exc
        # An S3Error (the server answered) propagates: the caller decides what its code means.

    async def ensure_bucket(self) -> None:
        if not await self._call(self.client.bucket_exists, self.bucket):
            try:
                await self._call(self.client.make_bucket, self.bucket)
            except Exception as exc:
                if _code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):  # a racing creator
                    raise

    async def ping(self) -> None:
        await self._call(self.client.bucket_exists, self.bucket)

    async def put(self, key: str, stream: BinaryIO, length: int, content_type: str) -> None:
        """Store ``length`` bytes read from ``stream``. The client reads and sends one part at a
        time (5 MiB, or a smaller file whole), one after another: a file's parts in parallel would
        hold several in memory, and an upload already sends its files in parallel."""
        await self._call(
            self.client.put_object,
            self.bucket,
            key,
            stream,
            length,
            content_type=content_type,
            num_parallel_uploads=1,
        )

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
