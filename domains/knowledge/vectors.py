"""Chunk vectors in Milvus through ``pymilvus``: one collection per base, keyed by chunk id.

A file's vectors are keyed by chunk id (``<file_id>-<seq>``, the same in every attempt). An upload's
first attempt inserts them (``insert``: none of its ids can have a vector yet); every other attempt
upserts them, so whatever a crashed or overtaken attempt left behind is overwritten, never
duplicated; the few past a new version's last chunk are deleted by id (``delete_chunks``: by primary
key, no scan of the collection, so its cost does not grow with the base). Every call blocks (gRPC),
so each runs in Milvus' own threads (``calls``) with a deadline: a slow or stalled Milvus never
stalls the event loop, the lease heartbeat or the other stores, and surfaces as
``StoreUnavailable``.

``pymilvus`` (with pandas and numpy) takes most of a second to import, so it is imported in those
threads on first use, never on the event loop of a task whose lease is already running.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from domains.knowledge.calls import blocking
from domains.knowledge.errors import CollectionMissing, StoreUnavailable

T = TypeVar("T")
SERVICE = "Milvus"
UPSERT_BATCH = 64
# Rows per plain insert (about 2 MiB of 1,024-dimension vectors per call).
INSERT_BATCH = 512
DELETE_BATCH = 1000
# Rows per call when the verifier reads a whole collection.
SCAN_BATCH = 4096
# Search and counts read their own writes: an indexed file is searchable at once.
CONSISTENCY = "Strong"
# Every base's collection is PREFIX + its id; other collections on the server are not ours.
PREFIX = "kb_"


def collection_name(base_id: str) -> str:
    # Collection names allow letters, digits and underscores; base ids are hex.
    return f"{PREFIX}{base_id}"


# pymilvus pings every 10 s even on an idle channel; servers built on grpc's defaults (milvus-lite)
# answer an idle client's pings more often than every 5 minutes with GOAWAY "too_many_pings", and
# the next call fails. Ping only during calls, and rarely: every call has its own timeout anyway.
GRPC_OPTIONS = {"grpc.keepalive_time_ms": 310_000, "grpc.keepalive_permit_without_calls": 0}


def connect(uri: str, timeout: float) -> Any:
    """A MilvusClient for one server (blocking: imports pymilvus, and the constructor connects)."""
    from pymilvus import MilvusClient

    return MilvusClient(uri=uri, timeout=timeout, grpc_options=GRPC_OPTIONS)


# Server codes for a request that is wrong whatever the server's state (a vector of another
# dimension, an id over its length, a bad filter): retrying it would fail for ever.
_INPUT_ERRORS = frozenset({6, 1100})


def _transient(exc: BaseException) -> bool:
    """A failure of the server or the way to it, not of our request: worth waiting out."""
    import grpc  # loaded with pymilvus
    from pymilvus.exceptions import (
        DataNotMatchException,
        DataTypeNotMatchException,
        MilvusException,
        ParamError,
    )

    if isinstance(exc, ParamError | DataNotMatchException | DataTypeNotMatchException):
        return False  # our bug, not the server's state
    if isinstance(exc, MilvusException) and (exc.is_input_error or exc.code in _INPUT_ERRORS):
        return False
    # A deadline or a stopped server surfaces as a raw gRPC error (DEADLINE_EXCEEDED), a killed one
    # as pymilvus' own (code 2, "Fail connecting to server").
    return isinstance(exc, MilvusException | grpc.RpcError | ConnectionError | TimeoutError)


def _message(exc: BaseException) -> str:
    import grpc

    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details() if hasattr(exc, 'details') else ''}"
    return str(getattr(exc, "message", exc))


async def call(deadline: float, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run one blocking pymilvus call (given ``timeout=deadline``) with its failures named for the
    caller: CollectionMissing, StoreUnavailable, or the exception itself for our own mistakes."""
    return await _classified(deadline, fn, *args, timeout=deadline, **kwargs)


async def _classified(deadline: float, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    try:
        return await blocking(SERVICE, deadline, fn, *args, **kwargs)
    except StoreUnavailable:
        raise
    except Exception as exc:
        if not _transient(exc):
            raise
        message = _message(exc)
        lowered = message.lower()
        # Gone, or not loaded (a restarted server leaves collections released): either way the
        # caller drops its cached handle and the rebuild creates or loads the collection.
        if getattr(exc, "code", None) == 100 or any(
            word in lowered for word in ("not exist", "not found", "released", "not loaded")
        ):
            raise CollectionMissing(message) from exc
        raise StoreUnavailable(SERVICE, message) from exc


def _create(client: Any, name: str, dimension: int, timeout: float) -> None:
    from pymilvus import DataType

    schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("chunk_id", DataType.VARCHAR, is_primary=True, max_length=128)
    schema.add_field("file_id", DataType.VARCHAR, max_length=64)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=dimension)
    index = client.prepare_index_params()
    # Vectors are unit length, so inner product is cosine similarity.
    index.add_index(field_name="vector", index_type="AUTOINDEX", metric_type="IP")
    client.create_collection(name, schema=schema, index_params=index, timeout=timeout)


async def ensure_collection(client: Any, name: str, dimension: int, deadline: float) -> None:
    """Create the collection unless it exists, and make sure it is loaded (searchable); concurrent
    creators are harmless."""
    if await call(deadline, client.has_collection, name):
        await call(deadline, client.load_collection, name)  # a no-op when loaded
        return
    try:
        await call(deadline, _create, client, name, dimension)
    except StoreUnavailable:
        if not await call(deadline, client.has_collection, name):
            raise  # not a lost race with another creator


async def base_collections(client: Any, deadline: float) -> set[str]:
    """The base ids that have a collection (other collections on the server are not ours)."""
    names: list[str] = await call(deadline, client.list_collections)
    return {name[len(PREFIX) :] for name in names if name.startswith(PREFIX)}


async def drop_collection(client: Any, name: str, deadline: float) -> bool:
    """Drop the collection if it exists; False when it was already gone."""
    if not await call(deadline, client.has_collection, name):
        return False
    await call(deadline, client.drop_collection, name)
    return True


@dataclass(frozen=True)
class Hit:
    chunk_id: str
    file_id: str
    score: float


class BaseIndex:
    """One base's collection (known to exist when the cache built this handle)."""

    def __init__(self, client: Any, name: str, deadline: float) -> None:
        self.client = client  # a MilvusClient; tests may wrap it
        self.name = name
        self.deadline = deadline

    async def delete_file(self, file_id: str) -> None:
        """Every vector of the file (a scan of the collection: for removing a file, not per ingest)."""
        await call(self.deadline, self.client.delete, self.name, filter=f'file_id == "{file_id}"')

    async def delete_chunks(self, chunk_ids: Sequence[str]) -> None:
        """These chunks' vectors, by primary key: no scan, so its cost does not grow with the base."""
        for start in range(0, len(chunk_ids), DELETE_BATCH):
            batch = list(chunk_ids[start : start + DELETE_BATCH])
            await call(self.deadline, self.client.delete, self.name, ids=batch)

    async def upsert(
        self, file_id: str, chunk_ids: Sequence[str], vectors: Sequence[Sequence[float]]
    ) -> None:
        rows = [
            {"chunk_id": c, "file_id": file_id, "vector": list(v)}
            for c, v in zip(chunk_ids, vectors, strict=True)
        ]
        for start in range(0, len(rows), UPSERT_BATCH):
            await call(self.deadline, self.client.upsert, self.name, rows[start : start + UPSERT_BATCH])

    async def insert(
        self, files: Sequence[tuple[str, Sequence[str], Sequence[Sequence[float]]]]
    ) -> None:
        """Vectors of chunk ids that have none here yet, for several files at once: (file id, chunk
        ids, vectors) each. A chunk id that has a vector already would then have two."""
        rows = [
            {"chunk_id": c, "file_id": file_id, "vector": list(v)}
            for file_id, chunk_ids, vectors in files
            for c, v in zip(chunk_ids, vectors, strict=True)
        ]
        for start in range(0, len(rows), INSERT_BATCH):
            await call(self.deadline, self.client.insert, self.name, rows[start : start + INSERT_BATCH])

    async def search(self, vector: Sequence[float], limit: int) -> list[Hit]:
        result = await call(
            self.deadline,
            self.client.search,
            self.name,
            data=[list(vector)],
            limit=limit,
            anns_field="vector",
            output_fields=["file_id"],
            search_params={"metric_type": "IP"},
            consistency_level=CONSISTENCY,
        )
        return [
            Hit(h["chunk_id"] if "chunk_id" in h else h["id"], h["entity"]["file_id"], float(h["distance"]))
            for h in result[0]
        ]

    async def vectors_by_file(self) -> Counter[str]:
        """How many vectors each file has here: one pass over the collection, a batch per call."""
        scan = await call(
            self.deadline,
            self.client.query_iterator,
            self.name,
            batch_size=SCAN_BATCH,
            filter="",
            output_fields=["file_id"],
            consistency_level=CONSISTENCY,
        )
        counts: Counter[str] = Counter()
        try:
            while batch := await _classified(self.deadline, scan.next):
                counts.update(row["file_id"] for row in batch)
        finally:
            scan.close()  # client-side only
        return counts

    async def count(self, file_id: str | None = None) -> int:
        rows = await call(
            self.deadline,
            self.client.query,
            self.name,
            filter=f'file_id == "{file_id}"' if file_id else "",
            output_fields=["count(*)"],
            consistency_level=CONSISTENCY,
        )
        return int(rows[0]["count(*)"])
