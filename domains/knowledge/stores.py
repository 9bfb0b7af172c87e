"""Where a knowledge process finds Milvus, the bucket and the embedder: built once per process.

``stores_for(settings)`` returns the process's ``KnowledgeStores`` for that configuration. Its
Milvus client and object store are built on first use; each base's ``BaseIndex`` (its collection
ensured) is built once per process however many tasks ask for it at the same moment.
"""

from __future__ import annotations

import asyncio
import importlib
import re
from dataclasses import dataclass
from typing import Any

from domains.knowledge import storage, vectors
from domains.knowledge.cache import KeyedOnce, PerProcess
from domains.knowledge.embedding import Embedder, load_embedder
from domains.knowledge.errors import StoresNotConfigured
from tasks_core.settings import Settings

ID_PATTERN = re.compile(r"^[0-9a-f]{32}$")
MILVUS = "DTASK_MILVUS_URI"
S3 = ("DTASK_MINIO_ENDPOINT", "DTASK_MINIO_ACCESS_KEY", "DTASK_MINIO_SECRET_KEY")


@dataclass(frozen=True)
class StoreConfig:
    milvus_uri: str | None
    minio_endpoint: str | None
    minio_access_key: str | None
    minio_secret_key: str | None
    minio_secure: bool
    bucket: str
    embedder: str
    # Seconds each store call may take (DTASK_STORE_TIMEOUT_SECONDS).
    deadline: float

    @classmethod
    def from_settings(cls, s: Settings) -> StoreConfig:
        return cls(
            s.milvus_uri,
            s.minio_endpoint,
            s.minio_access_key,
            s.minio_secret_key,
            s.minio_secure,
            s.minio_bucket,
            s.embedder,
            s.store_timeout_seconds,
        )

    def missing(self) -> list[str]:
        """The DTASK_* settings that must be set before knowledge bases work."""
        values = (self.milvus_uri, self.minio_endpoint, self.minio_access_key, self.minio_secret_key)
        return [name for name, value in zip((MILVUS, *S3), values, strict=True) if not value]


class KnowledgeStores:
    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.embedder: Embedder = load_embedder(config.embedder)
        self._clients: KeyedOnce[str, Any] = KeyedOnce()
        self.indexes: KeyedOnce[str, vectors.BaseIndex] = KeyedOnce(max_entries=4096)

    def require(self, *names: str) -> None:
        """Raise StoresNotConfigured unless the named settings (default: all of them) are set."""
        missing = [n for n in self.config.missing() if not names or n in names]
        if missing:
            raise StoresNotConfigured(missing)

    async def milvus(self) -> Any:
        self.require(MILVUS)
        uri = self.config.milvus_uri or ""

        async def build() -> Any:
            # pymilvus' first import (about a second) is no store call: it gets no deadline.
            await asyncio.to_thread(importlib.import_module, "pymilvus")
            return await vectors.call(self.config.deadline, vectors.connect, uri)

        return await self._clients.get("milvus", build)

    async def objects(self) -> storage.ObjectStore:
        """The deployment's bucket, created on first use."""
        self.require(*S3)
        c = self.config

        async def build() -> storage.ObjectStore:
            client = await asyncio.to_thread(  # the first import of minio: off the event loop
                storage.make_client,
                c.minio_endpoint or "",
                c.minio_access_key or "",
                c.minio_secret_key or "",
                c.minio_secure,
                c.deadline,
            )
            store = storage.ObjectStore(client, c.bucket, c.deadline)
            await store.ensure_bucket()
            return store

        store: storage.ObjectStore = await self._clients.get("objects", build)
        return store

    def forget_objects(self) -> None:
        """The bucket vanished under us: the next call re-creates it."""
        self._clients.forget("objects")

    async def index(self, base_id: str, dimension: int) -> vectors.BaseIndex:
        """The base's collection handle; built (collection ensured) once per process."""
        client = await self.milvus()
        name = vectors.collection_name(base_id)

        async def build() -> vectors.BaseIndex:
            await vectors.ensure_collection(client, name, dimension, self.config.deadline)
            return vectors.BaseIndex(client, name, self.config.deadline)

        return await self.indexes.get(base_id, build)


    async def drop(self, base_id: str) -> bool:
        """Drop the base's collection (False if it was gone already) and forget its handle."""
        client = await self.milvus()
        self.indexes.forget(base_id)
        return await vectors.drop_collection(client, vectors.collection_name(base_id), self.config.deadline)


_registry: PerProcess[StoreConfig, KnowledgeStores] = PerProcess()


def stores_for(settings: Settings) -> KnowledgeStores:
    """This process's stores for ``settings`` (a forked child starts with none of its parent's)."""
    config = StoreConfig.from_settings(settings)
    return _registry.get(config, lambda: KnowledgeStores(config))


async def milvus_fact(stores: KnowledgeStores) -> tuple[bool, str | None]:
    """Readiness: Milvus answers, or is not configured (then only knowledge routes are off)."""
    if not stores.config.milvus_uri:
        return True, f"not configured ({MILVUS} unset): knowledge routes answer 503"
    client = await stores.milvus()
    await vectors.call(min(1.0, stores.config.deadline), client.list_collections)
    return True, None


async def object_store_fact(stores: KnowledgeStores) -> tuple[bool, str | None]:
    missing = [n for n in stores.config.missing() if n in S3]
    if missing:
        return True, f"not configured ({', '.join(missing)} unset): knowledge routes answer 503"
    await (await stores.objects()).ping()
    return True, None
