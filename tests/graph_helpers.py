"""Helpers for the graph tests: bases whose chunks are written straight into the knowledge tables
(the graph reads nothing else, so no Milvus or S3 is needed), and the graph tables read back."""

from __future__ import annotations

import random
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import text

NAMES = (
    "Marie Curie",
    "Pierre Curie",
    "Paris",
    "Warsaw",
    "Sorbonne",
    "Nobel Prize",
    "Albert Einstein",
    "Niels Bohr",
    "Copenhagen",
    "Berlin",
    "Lise Meitner",
    "Otto Hahn",
    "Vienna",
    "CERN",
    "Geneva",
    "Ernest Rutherford",
    "Manchester",
    "Cambridge",
    "Royal Society",
    "Bank of England",
)
FILLER = ("worked with", "wrote to", "visited", "studied near", "argued about", "lectured in")


def sentences(rng: random.Random, n: int) -> str:
    """``n`` sentences, each naming two entities (never at the sentence's start, so each is kept)."""
    out = []
    for _ in range(n):
        a, b = rng.sample(NAMES, 2)
        out.append(f"Then {a} {rng.choice(FILLER)} {b} again.")
    return " ".join(out)


def corpus(files: int, chunks_per_file: int, seed: int = 7) -> list[list[str]]:
    rng = random.Random(seed)
    return [[sentences(rng, rng.randint(1, 4)) for _ in range(chunks_per_file)] for _ in range(files)]


async def make_base(
    svc: Any,
    files: Sequence[Sequence[str]],
    owner: str = "alice",
    status: str = "indexed",
) -> tuple[str, list[str]]:
    """A base with one file per entry of ``files`` (its chunks' texts), all in ``status``."""
    base_id = uuid.uuid4().hex
    file_ids = [uuid.uuid4().hex for _ in files]
    async with svc.engine.begin() as conn:
        await conn.execute(
            text(
                """INSERT INTO knowledge_bases (id, owner, name, embedder, dimension)
                VALUES (:id, :owner, :name, 'hashing', 8)"""
            ),
            {"id": base_id, "owner": owner, "name": f"graph-{base_id[:8]}"},
        )
        for file_id, chunks in zip(file_ids, files, strict=True):
            await add_file(conn, base_id, file_id, chunks, status)
    return base_id, file_ids


async def add_file(conn: Any, base_id: str, file_id: str, chunks: Sequence[str], status: str) -> None:
    await conn.execute(
        text(
            """INSERT INTO knowledge_files (file_id, kb_id, filename, file_type, status, chunk_count)
            VALUES (:id, :kb, :name, 'txt', :status, :n)"""
        ),
        {"id": file_id, "kb": base_id, "name": f"{file_id[:6]}.txt", "status": status, "n": len(chunks)},
    )
    token = uuid.uuid4()
    for seq, chunk in enumerate(chunks):
        await conn.execute(
            text(
                """INSERT INTO knowledge_chunks (chunk_id, file_id, seq, text, attempt_token)
                VALUES (:cid, :fid, :seq, :text, :tok)"""
            ),
            {"cid": f"{file_id}-{seq}", "fid": file_id, "seq": seq, "text": chunk, "tok": token},
        )


async def graph_tables(
    svc: Any, build_id: Any
) -> tuple[set[tuple[str, int, int]], set[tuple[str, str, int]]]:
    """A build's entities (name, mentions, chunks) and edges (source, target, weight), as stored."""
    async with svc.engine.connect() as conn:
        entities = (
            await conn.execute(
                text("SELECT name, mentions, chunks FROM graph_entities WHERE build_id = :id"),
                {"id": build_id},
            )
        ).all()
        edges = (
            await conn.execute(
                text("SELECT source, target, weight FROM graph_edges WHERE build_id = :id"),
                {"id": build_id},
            )
        ).all()
    return {tuple(r) for r in entities}, {tuple(r) for r in edges}


def expected_tables(texts: Sequence[str]) -> tuple[set[tuple[str, int, int]], set[tuple[str, str, int]]]:
    """The graph a clean build must store, computed here with the default extractor (no database):
    the entities of at least ``min_chunks`` chunks and the edges between them."""
    from domains.graph.extraction import CapitalisedTermExtractor, count_chunks, min_chunks

    counts = count_chunks(CapitalisedTermExtractor(), texts)
    least = min_chunks(len(texts))
    entities = {
        (n, counts.mentions[n], counts.chunks[n]) for n in counts.mentions if counts.chunks[n] >= least
    }
    kept = {n for n, _, _ in entities}
    edges = {(a, b, w) for (a, b), w in counts.edges.items() if a in kept and b in kept}
    return entities, edges


async def build_row(svc: Any, build_id: Any) -> dict[str, Any]:
    async with svc.engine.connect() as conn:
        row = (
            (await conn.execute(text("SELECT * FROM graph_builds WHERE id = :id"), {"id": build_id}))
            .mappings()
            .first()
        )
    assert row is not None, build_id
    return dict(row)
