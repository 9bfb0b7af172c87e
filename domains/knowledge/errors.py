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
