"""Helpers for the evaluation tests: a base of known documents, indexed for real, and looks into
PostgreSQL (what is really stored, not what the API says)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
from sqlalchemy import text

from tests.knowledge_helpers import ALICE, create_base, run_pending, upload

# Distinct vocabularies per document, so a question's words point at its own chunks.
TOPICS = ("river", "orbit", "violin", "glacier", "pepper", "lantern", "harbor", "meadow")


def document(topic: str, paragraphs: int = 3) -> str:
    """Paragraphs of words of one topic (deterministic), each its own sentence."""
    return "\n\n".join(
        " ".join(f"{topic}{(p * 13 + i * 7) % 97}" for i in range(40)) + "." for p in range(paragraphs)
    )


async def indexed_base(
    client: httpx.AsyncClient,
    svc: Any,
    docs: Sequence[tuple[str, str]],
    headers: dict[str, str] = ALICE,
) -> tuple[str, list[str]]:
    """A base holding ``docs`` (name, text), ingested in this process; its id and file ids."""
    base = await create_base(client, headers=headers)
    r = await upload(client, base, [(name, body.encode()) for name, body in docs], headers=headers)
    assert r.status_code == 202, r.text
    outcomes = await run_pending(svc)
    assert set(outcomes) == {"success"}, outcomes
    return base, [f["id"] for f in r.json()["files"]]


async def rows(svc: Any, sql: str, **params: Any) -> list[dict[str, Any]]:
    async with svc.engine.connect() as conn:
        return [dict(r) for r in (await conn.execute(text(sql), params)).mappings().all()]


async def dataset_row(svc: Any, dataset_id: str) -> dict[str, Any]:
    [row] = await rows(svc, "SELECT * FROM evaluation_datasets WHERE id = :id", id=dataset_id)
    return row


async def items(svc: Any, dataset_id: str) -> list[dict[str, Any]]:
    return await rows(
        svc, "SELECT * FROM evaluation_items WHERE dataset_id = :id ORDER BY seq", id=dataset_id
    )


def assert_distinct(stored: Sequence[dict[str, Any]], count: int) -> None:
    """Exactly ``count`` items at positions 0..count-1, no identity twice."""
    assert [i["seq"] for i in stored] == list(range(count))
    assert len({(i["chunk_id"], i["ordinal"]) for i in stored}) == count
