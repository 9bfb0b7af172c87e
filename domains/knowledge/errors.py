"""Why a knowledge operation could not reach its stores; routes turn these into 503."""

from __future__ import annotations


class StoreError(Exception):
    """Base of the errors below."""


class StoresNotConfigured(StoreError):
    def __init__(self, missing: list[str]) -> None:
        self.missing = missing
        super().__init__(
            "knowledge bases need Milvus and an S3 object store; not configured: " + ", ".join(missing)
        )


class StoreUnavailable(StoreError):
    def __init__(self, service: str, detail: str) -> None:
        self.service = service
        super().__init__(f"{service} is not reachable: {detail}"[:500])


class CollectionMissing(StoreError):
    """A base's Milvus collection is gone (dropped outside, or the base is being deleted)."""


class ObjectMissing(StoreError):
    """A file's original is not in the bucket."""


class EmbeddingRejected(Exception):
    """The embedder refused the texts for good: the request, the key, the model or the answer is
    wrong, so trying again would meet it again (the files end error_indexing with its message)."""
