"""Texts -> unit vectors. The default is local and deterministic; a real model plugs in by name.

``DTASK_EMBEDDER`` is ``hashing`` (the default, ``domains.knowledge.hashing``) or
``module:attribute`` naming an ``Embedder`` instance, class or factory. ``embed_texts`` is how
every caller embeds: an embedder with an ``aembed`` coroutine (a network client) is awaited, a
plain one (CPU work) runs in a thread.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence
from typing import Protocol, TypeGuard, runtime_checkable

from domains.knowledge.hashing import DEFAULT_DIMENSION, HashingEmbedder
from tasks_core.registry import import_path

__all__ = [
    "DEFAULT_DIMENSION",
    "Embedder",
    "HashingEmbedder",
    "embed_texts",
    "is_embedder",
    "load_embedder",
    "mismatch",
]


@runtime_checkable
class Embedder(Protocol):
    """What indexing and search need from a model: a stable name, a dimension, and vectors."""

    name: str

    @property
    def dimension(self) -> int: ...  # read-only: a network client may learn it from its server

    def embed(self, texts: Sequence[str]) -> list[list[float]]: ...


async def embed_texts(embedder: Embedder, texts: Sequence[str]) -> list[list[float]]:
    """The texts' vectors, without blocking the event loop."""
    aembed = getattr(embedder, "aembed", None)
    if aembed is not None:
        vectors: list[list[float]] = await aembed(texts)
        return vectors
    return await asyncio.to_thread(embedder.embed, texts)


def mismatch(embedder: Embedder, built_with: str, dimension: int, who: str = "this process") -> str | None:
    """One line saying why ``embedder`` cannot search or index a base built with ``built_with``
    (``dimension``) and which setting fixes it; None when they match. Reading the dimension may
    ask a network embedder's server (an ``EmbeddingUnavailable`` then)."""
    if (embedder.name, embedder.dimension) == (built_with, dimension):
        return None
    if embedder.name == built_with:
        fix = (
            "the same model now gives vectors of another size: point it at the server the base was built with"
        )
    elif built_with.startswith("openai:"):
        fix = f"set DTASK_EMBEDDER=openai and DTASK_EMBEDDING_MODEL={built_with.removeprefix('openai:')}"
    else:
        fix = "set DTASK_EMBEDDER to match"
    return (
        f"the base was built with embedder {built_with} ({dimension} dimensions); {who} embeds with "
        f"{embedder.name} ({embedder.dimension} dimensions): {fix}"
    )


def is_embedder(value: object) -> TypeGuard[Embedder]:
    """``isinstance(value, Embedder)`` without reading the attributes: on Python 3.11 that check
    calls every property, and a network client's ``dimension`` may ask its server."""
    missing = object()
    return all(
        inspect.getattr_static(value, attr, missing) is not missing for attr in ("name", "dimension", "embed")
    )


def load_embedder(spec: str) -> Embedder:
    """``hashing`` / ``hashing:DIM``, ``openai``, ``sentence-transformers:PATH`` or ``module:attribute``
    (an instance, or a class/factory)."""
    name, _, arg = spec.partition(":")
    if name == "hashing":
        return HashingEmbedder(int(arg) if arg else DEFAULT_DIMENSION)
    if name == "sentence-transformers":  # a model directory, in-process (optional extra)
        target = import_path("domains.knowledge.local_model:SentenceTransformerEmbedder")(arg)
    else:
        # ``openai``: the DTASK_EMBEDDING_* client of an OpenAI-compatible server
        target = import_path("domains.knowledge.openai_embedder:from_settings" if spec == "openai" else spec)
    embedder = target() if callable(target) and not is_embedder(target) else target
    if not is_embedder(embedder):
        raise ValueError(f"DTASK_EMBEDDER={spec!r} is not an Embedder (name, dimension, embed)")
    return embedder
