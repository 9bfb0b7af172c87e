"""The graph domain's SQL: builds, their checkpointed counts, and the reads the routes serve.

A build's writes are fenced twice: they run in the attempt's owning transaction (the runtime's
fence: this attempt still owns the task, its lease unexpired at commit), and each batch moves the
checkpoint by compare-and-set on the attempt token and the previous position. The counts of a batch
commit with the checkpoint step that covers them, so a batch is counted once, or not at all.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from domains.graph.extraction import BatchCounts, min_chunks
from domains.graph.model import BUILDING, BUILT

Row = dict[str, Any]
Position = tuple[str, int] | None  # (file_id, seq) of the last chunk counted; None before the first
NOW = "clock_timestamp()"


def _one(result: Any) -> Row | None:
    row = result.mappings().first()
    return None if row is None else dict(row)


# ------------------------------------------------------------------------------------------------ builds


async def create_build(conn: AsyncConnection, base_id: str, task_id: uuid.UUID) -> Row:
    row = _one(
        await conn.execute(
            text(
                """INSERT INTO graph_builds (id, base_id, task_id)
                VALUES (:id, :base, :task) RETURNING *"""
            ),
            {"id": uuid.uuid4(), "base": base_id, "task": task_id},
        )
    )
    assert row is not None
    return row


async def build_of_task(conn: AsyncConnection, task_id: uuid.UUID) -> Row | None:
    return _one(await conn.execute(text("SELECT * FROM graph_builds WHERE task_id = :t"), {"t": task_id}))


async def take_over(
    conn: AsyncConnection, task_id: uuid.UUID, token: uuid.UUID, extractor: str
) -> Row | None:
    """The task's build, now bound to this attempt (None: no build in progress for it). The first
    attempt records its extractor; a retry finds the first one's there."""
    return _one(
        await conn.execute(
            text(
                f"""UPDATE graph_builds SET attempt_token = :tok, extractor = coalesce(extractor, :ex),
                updated_at = {NOW}
            WHERE task_id = :t AND status = '{BUILDING}' RETURNING *"""
            ),
            {"t": task_id, "tok": token, "ex": extractor},
        )
    )


async def set_total(conn: AsyncConnection, build_id: uuid.UUID, token: uuid.UUID, total: int) -> None:
    await conn.execute(
        text("UPDATE graph_builds SET chunk_total = :n WHERE id = :id AND attempt_token = :tok"),
        {"id": build_id, "tok": token, "n": total},
    )


# ------------------------------------------------------------------------------------------------ chunks

# The chunks a graph is built from: those of the base's indexed files, in (file_id, seq) order.
_CHUNKS = """FROM knowledge_chunks c JOIN knowledge_files f ON f.file_id = c.file_id
    WHERE f.kb_id = :base AND f.status = 'indexed'"""


async def count_chunks(conn: AsyncConnection, base_id: str) -> int:
    return int((await conn.execute(text(f"SELECT count(*) {_CHUNKS}"), {"base": base_id})).scalar_one())


async def chunks_after(
    conn: AsyncConnection, base_id: str, after: Position, limit: int
) -> list[tuple[str, int, str]]:
    params: dict[str, Any] = {"base": base_id, "limit": limit}
    where = ""
    if after is not None:
        where = " AND (c.file_id, c.seq) > (:file, :seq)"
        params.update(file=after[0], seq=after[1])
    rows = await conn.execute(
        text(f"SELECT c.file_id, c.seq, c.text {_CHUNKS}{where} ORDER BY c.file_id, c.seq LIMIT :limit"),
        params,
    )
    return [(r[0], int(r[1]), r[2]) for r in rows.all()]


# ------------------------------------------------------------------------------------------------ batches


async def checkpoint(
    conn: AsyncConnection,
    build_id: uuid.UUID,
    token: uuid.UUID,
    before: Position,
    after: tuple[str, int],
    chunks: int,
) -> bool:
    """Move the checkpoint from ``before`` to ``after`` as this attempt; False if it is not there
    (another attempt took the build over, or this step committed already)."""
    result = await conn.execute(
        text(
            f"""UPDATE graph_builds
            SET cursor_file = :file, cursor_seq = :seq, chunks_done = chunks_done + :n, updated_at = {NOW}
            WHERE id = :id AND attempt_token = :tok AND status = '{BUILDING}'
              AND cursor_file IS NOT DISTINCT FROM :old_file AND cursor_seq IS NOT DISTINCT FROM :old_seq"""
        ),
        {
            "id": build_id,
            "tok": token,
            "file": after[0],
            "seq": after[1],
            "n": chunks,
            "old_file": None if before is None else before[0],
            "old_seq": None if before is None else before[1],
        },
    )
    return bool(result.rowcount)


async def add_counts(conn: AsyncConnection, build_id: uuid.UUID, counts: BatchCounts) -> None:
    """Add one batch's counts (only ever after its checkpoint step, in the same transaction)."""
    if counts.mentions:
        names = sorted(counts.mentions)  # a fixed order: concurrent upserts never deadlock
        await conn.execute(
            text(
                """INSERT INTO graph_entities (build_id, name, mentions, chunks)
                SELECT :id, * FROM unnest(CAST(:names AS text[]), CAST(:mentions AS int[]),
                                          CAST(:chunks AS int[]))
                ON CONFLICT (build_id, name) DO UPDATE
                SET mentions = graph_entities.mentions + EXCLUDED.mentions,
                    chunks = graph_entities.chunks + EXCLUDED.chunks"""
            ),
            {
                "id": build_id,
                "names": names,
                "mentions": [counts.mentions[n] for n in names],
                "chunks": [counts.chunks[n] for n in names],
            },
        )
    if counts.edges:
        pairs = sorted(counts.edges)
        await conn.execute(
            text(
                """INSERT INTO graph_edges (build_id, source, target, weight)
                SELECT :id, * FROM unnest(CAST(:sources AS text[]), CAST(:targets AS text[]),
                                          CAST(:weights AS int[]))
                ON CONFLICT (build_id, source, target) DO UPDATE
                SET weight = graph_edges.weight + EXCLUDED.weight"""
            ),
            {
                "id": build_id,
                "sources": [a for a, _ in pairs],
                "targets": [b for _, b in pairs],
                "weights": [counts.edges[p] for p in pairs],
            },
        )


async def position(conn: AsyncConnection, build_id: uuid.UUID) -> tuple[Position, int, str] | None:
    """The build's checkpoint, chunks counted so far, and status (None: the build is gone)."""
    row = (
        await conn.execute(
            text("SELECT cursor_file, cursor_seq, chunks_done, status FROM graph_builds WHERE id = :id"),
            {"id": build_id},
        )
    ).first()
    if row is None:
        return None
    pos = None if row[0] is None else (row[0], int(row[1]))
    return pos, int(row[2]), row[3]


# ------------------------------------------------------------------------------------------------ hooks


async def finish(conn: AsyncConnection, task_id: uuid.UUID) -> Row | None:
    """The task's build becomes the base's graph, without its rare entities (``min_chunks``); older
    finished builds of the base go. All in the task's success transaction: a graph is pruned once,
    whole, whatever the attempts before."""
    building = _one(
        await conn.execute(
            text(
                f"""SELECT id, chunks_done FROM graph_builds
                WHERE task_id = :t AND status = '{BUILDING}' FOR UPDATE"""
            ),
            {"t": task_id},
        )
    )
    if building is None:
        return None
    await _prune(conn, building["id"], min_chunks(int(building["chunks_done"])))
    row = _one(
        await conn.execute(
            text(
                f"""UPDATE graph_builds b SET status = '{BUILT}', finished_at = {NOW}, updated_at = {NOW},
                entity_count = (SELECT count(*) FROM graph_entities e WHERE e.build_id = b.id),
                edge_count = (SELECT count(*) FROM graph_edges e WHERE e.build_id = b.id)
            WHERE task_id = :t AND status = '{BUILDING}' RETURNING *"""
            ),
            {"t": task_id},
        )
    )
    if row is not None:
        await conn.execute(
            text(
                f"""DELETE FROM graph_builds
                WHERE base_id = :base AND id <> :id AND status <> '{BUILDING}' AND created_at <= :created"""
            ),
            {"base": row["base_id"], "id": row["id"], "created": row["created_at"]},
        )
    return row


async def _prune(conn: AsyncConnection, build_id: uuid.UUID, least: int) -> None:
    """Drop the build's entities of fewer than ``least`` chunks, and the edges that touch them."""
    if least <= 1:
        return
    await conn.execute(
        text("DELETE FROM graph_entities WHERE build_id = :id AND chunks < :least"),
        {"id": build_id, "least": least},
    )
    await conn.execute(
        text(
            """DELETE FROM graph_edges e WHERE e.build_id = :id
            AND (NOT EXISTS (SELECT 1 FROM graph_entities n WHERE n.build_id = :id AND n.name = e.source)
              OR NOT EXISTS (SELECT 1 FROM graph_entities n WHERE n.build_id = :id AND n.name = e.target))"""
        ),
        {"id": build_id},
    )


async def fail(conn: AsyncConnection, task_id: uuid.UUID, status: str, message: str) -> Row | None:
    """The task's unfinished build ends ``status`` with the message; its partial counts go."""
    row = _one(
        await conn.execute(
            text(
                f"""UPDATE graph_builds SET status = :status, error_message = :msg, finished_at = {NOW},
                updated_at = {NOW}
            WHERE task_id = :t AND status = '{BUILDING}' RETURNING *"""
            ),
            {"t": task_id, "status": status, "msg": message[:2000]},
        )
    )
    if row is not None:
        for table in ("graph_entities", "graph_edges"):
            await conn.execute(text(f"DELETE FROM {table} WHERE build_id = :id"), {"id": row["id"]})
    return row


# ------------------------------------------------------------------------------------------------ reads


async def latest_build(conn: AsyncConnection, base_id: str, status: str | None = None) -> Row | None:
    return _one(
        await conn.execute(
            text(
                """SELECT * FROM graph_builds WHERE base_id = :base
                AND (CAST(:status AS text) IS NULL OR status = :status)
                ORDER BY created_at DESC, id DESC LIMIT 1"""
            ),
            {"base": base_id, "status": status},
        )
    )


async def latest_builds(conn: AsyncConnection, base_ids: list[str]) -> dict[str, Row]:
    """Each base's newest build of any status, with its task's status: the dashboard's list."""
    rows = await conn.execute(
        text(
            """SELECT DISTINCT ON (b.base_id) b.*, t.status AS task_status
            FROM graph_builds b LEFT JOIN tasks t ON t.id = b.task_id WHERE b.base_id = ANY(:ids)
            ORDER BY b.base_id, b.created_at DESC, b.id DESC"""
        ),
        {"ids": base_ids},
    )
    return {r["base_id"]: dict(r) for r in rows.mappings().all()}


async def entities_page(
    conn: AsyncConnection, build_id: uuid.UUID, limit: int, after: tuple[int, str] | None
) -> list[Row]:
    """Most mentioned first, then by name; keyset-paged after (mentions, name)."""
    where = ""
    params: dict[str, Any] = {"id": build_id, "limit": limit}
    if after is not None:
        where = " AND (mentions < :m OR (mentions = :m AND name > :name))"
        params.update(m=after[0], name=after[1])
    rows = await conn.execute(
        text(
            f"""SELECT name, mentions, chunks FROM graph_entities WHERE build_id = :id{where}
            ORDER BY mentions DESC, name LIMIT :limit"""
        ),
        params,
    )
    return [dict(r) for r in rows.mappings().all()]


async def entity(conn: AsyncConnection, build_id: uuid.UUID, name: str) -> Row | None:
    return _one(
        await conn.execute(
            text("SELECT name, mentions, chunks FROM graph_entities WHERE build_id = :id AND name = :name"),
            {"id": build_id, "name": name},
        )
    )


async def neighbors(conn: AsyncConnection, build_id: uuid.UUID, name: str, limit: int) -> list[Row]:
    """Entities that share chunks with ``name``: heaviest edge first, then by name."""
    rows = await conn.execute(
        text(
            """SELECT n.name, e.weight, n.mentions FROM (
                SELECT target AS name, weight FROM graph_edges WHERE build_id = :id AND source = :name
                UNION ALL
                SELECT source, weight FROM graph_edges WHERE build_id = :id AND target = :name) e
            JOIN graph_entities n ON n.build_id = :id AND n.name = e.name
            ORDER BY e.weight DESC, e.name LIMIT :limit"""
        ),
        {"id": build_id, "name": name, "limit": limit},
    )
    return [dict(r) for r in rows.mappings().all()]
