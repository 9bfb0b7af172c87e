"""The evaluation domain's SQL: datasets, items, runs and run outcomes (task rows stay in tasks_core).

Reads return plain dicts. A handler's writes run inside its owning transaction and name the task
and attempt that own the dataset or run, so they match no row once another attempt (or the task
of a resume) holds it.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from domains.evaluation.generation import Chunk
from domains.evaluation.model import CANCELLED, COMPLETED, FAILED, GENERATING, RUNNING
from domains.knowledge.catalog import decode_cursor, encode_cursor

Row = dict[str, Any]
NOW = "clock_timestamp()"
_ACTIVE = "('pending', 'running')"


def new_id() -> str:
    return uuid.uuid4().hex


async def _one(conn: AsyncConnection, sql: str, **params: Any) -> Row | None:
    row = (await conn.execute(text(sql), params)).mappings().first()
    return None if row is None else dict(row)


async def _all(conn: AsyncConnection, sql: str, **params: Any) -> list[Row]:
    return [dict(r) for r in (await conn.execute(text(sql), params)).mappings().all()]


# ------------------------------------------------------------------------------------------------ chunks


async def base_chunks(conn: AsyncConnection, base_id: str) -> list[Chunk]:
    """The texts of the base's indexed files, with their file: what a dataset is drawn from (the
    plan spreads it over the files; the order here only makes reads repeatable)."""
    rows = await _all(
        conn,
        """SELECT c.chunk_id, c.text, c.file_id FROM knowledge_chunks c
        JOIN knowledge_files f ON f.file_id = c.file_id
        WHERE f.kb_id = :kb AND f.status = 'indexed' ORDER BY c.chunk_id""",
        kb=base_id,
    )
    return [Chunk(r["chunk_id"], r["text"], r["file_id"]) for r in rows]


async def chunk_count(conn: AsyncConnection, base_id: str) -> int:
    return int(
        (
            await conn.execute(
                text(
                    """SELECT count(*) FROM knowledge_chunks c JOIN knowledge_files f ON f.file_id = c.file_id
            WHERE f.kb_id = :kb AND f.status = 'indexed'"""
                ),
                {"kb": base_id},
            )
        ).scalar_one()
    )


async def indexed_chunk_ids(conn: AsyncConnection, base_id: str, chunk_ids: Sequence[str]) -> set[str]:
    """Of these chunk ids, those of indexed files of the base (a stale vector counts for nothing)."""
    rows = (
        await conn.execute(
            text(
                """SELECT c.chunk_id FROM knowledge_chunks c JOIN knowledge_files f ON f.file_id = c.file_id
        WHERE c.chunk_id = ANY(:ids) AND f.kb_id = :kb AND f.status = 'indexed'"""
            ),
            {"ids": list(chunk_ids), "kb": base_id},
        )
    ).all()
    return {r[0] for r in rows}


# ------------------------------------------------------------------------------------------------ datasets


async def insert_dataset(
    conn: AsyncConnection, owner: str, base_id: str, target: int, task_id: uuid.UUID, dataset_id: str
) -> Row:
    row = await _one(
        conn,
        """INSERT INTO evaluation_datasets (id, owner, base_id, target, task_id)
        VALUES (:id, :owner, :base, :target, :task) RETURNING *""",
        id=dataset_id,
        owner=owner,
        base=base_id,
        target=target,
        task=task_id,
    )
    assert row is not None
    return row


async def get_dataset(conn: AsyncConnection, dataset_id: str, *, lock: bool = False) -> Row | None:
    """The dataset, and whether its task is still active."""
    return await _one(
        conn,
        f"""SELECT d.*, t.status IN {_ACTIVE} AS task_active FROM evaluation_datasets d
        LEFT JOIN tasks t ON t.id = d.task_id WHERE d.id = :id"""
        + (" FOR UPDATE OF d" if lock else ""),
        id=dataset_id,
    )


async def resume_dataset(conn: AsyncConnection, dataset_id: str, task_id: uuid.UUID) -> None:
    """Hand a failed or cancelled dataset to a new task: generating again, from its item count."""
    await conn.execute(
        text(
            f"""UPDATE evaluation_datasets SET status = '{GENERATING}', task_id = :task, attempt_token = NULL,
               error_message = NULL, updated_at = {NOW}
        WHERE id = :id AND status IN ('{FAILED}', '{CANCELLED}')"""
        ),
        {"id": dataset_id, "task": task_id},
    )


async def list_items(conn: AsyncConnection, dataset_id: str, after: int, limit: int) -> list[Row]:
    return await _all(
        conn,
        """SELECT seq, chunk_id, ordinal, question, answer, relevant_chunk_ids FROM evaluation_items
        WHERE dataset_id = :id AND seq > :after ORDER BY seq LIMIT :limit""",
        id=dataset_id,
        after=after,
        limit=limit,
    )


async def list_datasets(
    conn: AsyncConnection, owner: str | None, *, status: str | None, limit: int, cursor: str | None
) -> tuple[list[Row], str | None]:
    """Datasets (of ``owner``; None: everyone's) newest first, keyset-paged on (created_at, id) with
    the knowledge catalog's cursors, with their base's name, their task's status and how many runs
    they have: the dashboard's list. A cursor we did not make raises ValueError."""
    at, after = decode_cursor(cursor) if cursor else (None, "")
    rows = await _all(
        conn,
        """SELECT d.id, d.owner, d.base_id, b.name AS base_name, d.target, d.item_count, d.status,
                  d.error_message, d.task_id, t.status AS task_status, d.generator, d.created_at,
                  d.updated_at, (SELECT count(*) FROM evaluation_runs r WHERE r.dataset_id = d.id) AS runs
        FROM evaluation_datasets d JOIN knowledge_bases b ON b.id = d.base_id
        LEFT JOIN tasks t ON t.id = d.task_id
        WHERE (CAST(:owner AS text) IS NULL OR d.owner = :owner)
          AND (CAST(:status AS text) IS NULL OR d.status = :status)
          AND (CAST(:at AS timestamptz) IS NULL OR (d.created_at, d.id) < (CAST(:at AS timestamptz), :after))
        ORDER BY d.created_at DESC, d.id DESC LIMIT :limit""",
        owner=owner,
        status=status,
        at=at,
        after=after,
        limit=limit + 1,
    )
    return _keyset(rows, limit)


def _keyset(rows: list[Row], limit: int) -> tuple[list[Row], str | None]:
    page = rows[:limit]
    return page, encode_cursor(page[-1]["created_at"], page[-1]["id"]) if len(rows) > limit else None


async def dataset_counts(conn: AsyncConnection, owner: str | None) -> dict[str, int]:
    """Datasets by status (of ``owner``; None: everyone's)."""
    rows = await _all(
        conn,
        """SELECT status, count(*) AS n FROM evaluation_datasets
        WHERE CAST(:owner AS text) IS NULL OR owner = :owner GROUP BY status""",
        owner=owner,
    )
    return {r["status"]: int(r["n"]) for r in rows}


# -- by the generating task


async def claim_dataset(
    conn: AsyncConnection, dataset_id: str, task_id: uuid.UUID, token: uuid.UUID, generator: str
) -> Row | None:
    """Bind the dataset to this attempt; None unless this task is generating it."""
    return await _one(
        conn,
        f"""UPDATE evaluation_datasets SET attempt_token = :tok, generator = :gen, updated_at = {NOW}
        WHERE id = :id AND task_id = :task AND status = '{GENERATING}' RETURNING *""",
        id=dataset_id,
        task=task_id,
        tok=token,
        gen=generator,
    )


async def item_identities(conn: AsyncConnection, dataset_id: str) -> set[tuple[str, int]]:
    rows = (
        await conn.execute(
            text("SELECT chunk_id, ordinal FROM evaluation_items WHERE dataset_id = :id"), {"id": dataset_id}
        )
    ).all()
    return {(r[0], int(r[1])) for r in rows}


async def add_items(
    conn: AsyncConnection,
    dataset_id: str,
    task_id: uuid.UUID,
    token: uuid.UUID,
    items: Sequence[Row],
) -> int | None:
    """Append items (chunk_id, ordinal, question, answer, relevant_chunk_ids) as the owning attempt;
    the new item count, or None if the dataset is not this attempt's. Locks the dataset row, so
    positions follow the committed count; the unique identity refuses an item stored before."""
    row = await _one(
        conn,
        f"""SELECT item_count, target FROM evaluation_datasets
        WHERE id = :id AND task_id = :task AND attempt_token = :tok AND status = '{GENERATING}'
        FOR UPDATE""",
        id=dataset_id,
        task=task_id,
        tok=token,
    )
    if row is None:
        return None
    count = int(row["item_count"])
    items = list(items)[: int(row["target"]) - count]
    if items:
        await conn.execute(
            text(
                """INSERT INTO evaluation_items
                   (dataset_id, seq, chunk_id, ordinal, question, answer, relevant_chunk_ids, attempt_token)
            VALUES (:ds, :seq, :chunk_id, :ordinal, :question, :answer, :relevant_chunk_ids, :tok)"""
            ),
            [{**item, "ds": dataset_id, "seq": count + i, "tok": token} for i, item in enumerate(items)],
        )
        await conn.execute(
            text(f"UPDATE evaluation_datasets SET item_count = :n, updated_at = {NOW} WHERE id = :id"),
            {"id": dataset_id, "n": count + len(items)},
        )
    return count + len(items)


# -- terminal hooks (inside the task's terminal transaction)


async def complete_dataset(conn: AsyncConnection, task_id: uuid.UUID) -> int:
    """Success: the dataset this task generated is complete, if it holds its target."""
    result = await conn.execute(
        text(
            f"""UPDATE evaluation_datasets SET status = CASE WHEN item_count = target THEN '{COMPLETED}'
                   ELSE '{FAILED}' END,
               error_message = CASE WHEN item_count = target THEN NULL
                   ELSE 'task ' || CAST(:task AS text) || ' ended with ' || item_count || ' of '
                        || target || ' items; resume to continue' END,
               updated_at = {NOW}
        WHERE task_id = :task AND status = '{GENERATING}'"""
        ),
        {"task": task_id},
    )
    return int(result.rowcount)


async def end_dataset(conn: AsyncConnection, task_id: uuid.UUID, status: str, reason: str) -> int:
    """Failure or cancel: the dataset keeps its items and says why (I6)."""
    result = await conn.execute(
        text(
            f"""UPDATE evaluation_datasets SET status = :status, error_message = :reason, updated_at = {NOW}
        WHERE task_id = :task AND status = '{GENERATING}'"""
        ),
        {"task": task_id, "status": status, "reason": reason[:2000]},
    )
    return int(result.rowcount)


# ------------------------------------------------------------------------------------------------ runs


async def insert_run(conn: AsyncConnection, run: Row) -> Row:
    row = await _one(
        conn,
        """INSERT INTO evaluation_runs (id, owner, dataset_id, base_id, top_k, items_total, task_id)
        VALUES (:id, :owner, :dataset_id, :base_id, :top_k, :items_total, :task_id) RETURNING *""",
        **run,
    )
    assert row is not None
    return row


async def get_run(conn: AsyncConnection, run_id: str) -> Row | None:
    return await _one(conn, "SELECT * FROM evaluation_runs WHERE id = :id", id=run_id)


async def list_runs(
    conn: AsyncConnection,
    owner: str | None,
    *,
    status: str | None = None,
    limit: int,
    cursor: str | None = None,
    dataset_id: str | None = None,
) -> tuple[list[Row], str | None]:
    """Runs (of ``owner``; None: everyone's; of one dataset if given) newest first, keyset-paged like
    list_datasets, with their base's name and their task's status: the dashboard's lists."""
    at, after = decode_cursor(cursor) if cursor else (None, "")
    rows = await _all(
        conn,
        """SELECT r.id, r.owner, r.dataset_id, r.base_id, b.name AS base_name, r.top_k, r.status,
                  r.items_total, r.items_done, r.metrics, r.error_message, r.task_id,
                  t.status AS task_status, r.created_at, r.updated_at
        FROM evaluation_runs r JOIN knowledge_bases b ON b.id = r.base_id
        LEFT JOIN tasks t ON t.id = r.task_id
        WHERE (CAST(:owner AS text) IS NULL OR r.owner = :owner)
          AND (CAST(:ds AS text) IS NULL OR r.dataset_id = :ds)
          AND (CAST(:status AS text) IS NULL OR r.status = :status)
          AND (CAST(:at AS timestamptz) IS NULL OR (r.created_at, r.id) < (CAST(:at AS timestamptz), :after))
        ORDER BY r.created_at DESC, r.id DESC LIMIT :limit""",
        owner=owner,
        ds=dataset_id,
        status=status,
        at=at,
        after=after,
        limit=limit + 1,
    )
    return _keyset(rows, limit)


async def run_counts(conn: AsyncConnection, owner: str | None) -> dict[str, int]:
    """Runs by status (of ``owner``; None: everyone's)."""
    rows = await _all(
        conn,
        """SELECT status, count(*) AS n FROM evaluation_runs
        WHERE CAST(:owner AS text) IS NULL OR owner = :owner GROUP BY status""",
        owner=owner,
    )
    return {r["status"]: int(r["n"]) for r in rows}


async def list_run_items(conn: AsyncConnection, run_id: str, after: int, limit: int) -> list[Row]:
    return await _all(
        conn,
        """SELECT o.seq, i.question, i.chunk_id, i.relevant_chunk_ids, o.hit, o.rank, o.recall,
                  o.retrieved_chunk_ids
        FROM evaluation_run_items o JOIN evaluation_runs r ON r.id = o.run_id
        JOIN evaluation_items i ON i.dataset_id = r.dataset_id AND i.seq = o.seq
        WHERE o.run_id = :id AND o.seq > :after ORDER BY o.seq LIMIT :limit""",
        id=run_id,
        after=after,
        limit=limit,
    )


async def claim_run(conn: AsyncConnection, run_id: str, task_id: uuid.UUID, token: uuid.UUID) -> Row | None:
    return await _one(
        conn,
        f"""UPDATE evaluation_runs SET attempt_token = :tok, updated_at = {NOW}
        WHERE id = :id AND task_id = :task AND status = '{RUNNING}' RETURNING *""",
        id=run_id,
        task=task_id,
        tok=token,
    )


async def pending_items(conn: AsyncConnection, run: Row, limit: int) -> list[Row]:
    """The next dataset items this run has no outcome for, in order."""
    return await _all(
        conn,
        """SELECT i.seq, i.question, i.relevant_chunk_ids FROM evaluation_items i
        WHERE i.dataset_id = :ds AND NOT EXISTS (
            SELECT 1 FROM evaluation_run_items o WHERE o.run_id = :run AND o.seq = i.seq)
        ORDER BY i.seq LIMIT :limit""",
        ds=run["dataset_id"],
        run=run["id"],
        limit=limit,
    )


async def add_outcomes(
    conn: AsyncConnection, run_id: str, task_id: uuid.UUID, token: uuid.UUID, outcomes: Sequence[Row]
) -> int | None:
    """Checkpoint a batch of outcomes as the owning attempt; the run's new done count, or None if
    the run is not this attempt's. An outcome stored before is kept, not counted twice."""
    row = await _one(
        conn,
        f"""SELECT id FROM evaluation_runs
        WHERE id = :id AND task_id = :task AND attempt_token = :tok AND status = '{RUNNING}' FOR UPDATE""",
        id=run_id,
        task=task_id,
        tok=token,
    )
    if row is None:
        return None
    if outcomes:
        await conn.execute(
            text(
                """INSERT INTO evaluation_run_items (run_id, seq, hit, rank, recall, retrieved_chunk_ids,
                                                   attempt_token)
            VALUES (:run, :seq, :hit, :rank, :recall, :retrieved_chunk_ids, :tok)
            ON CONFLICT (run_id, seq) DO NOTHING"""
            ),
            [{**o, "run": run_id, "tok": token} for o in outcomes],
        )
    done = await _one(
        conn,
        f"""UPDATE evaluation_runs SET updated_at = {NOW},
               items_done = (SELECT count(*) FROM evaluation_run_items WHERE run_id = :id)
        WHERE id = :id RETURNING items_done""",
        id=run_id,
    )
    assert done is not None
    return int(done["items_done"])


async def complete_run(conn: AsyncConnection, task_id: uuid.UUID) -> int:
    """Success: metrics from the stored outcomes, in the task's success transaction."""
    result = await conn.execute(
        text(
            f"""UPDATE evaluation_runs r SET
               status = CASE WHEN r.items_done = r.items_total THEN '{COMPLETED}' ELSE '{FAILED}' END,
               metrics = CASE WHEN r.items_done = r.items_total THEN m.metrics END,
               error_message = CASE WHEN r.items_done = r.items_total THEN NULL
                   ELSE 'the task ended with ' || r.items_done || ' of ' || r.items_total || ' items' END,
               updated_at = {NOW}
        FROM (SELECT r2.id, jsonb_build_object(
                  'hit_rate', coalesce(avg(CASE WHEN o.hit THEN 1.0 ELSE 0.0 END), 0),
                  'recall', coalesce(avg(o.recall), 0),
                  'mrr', coalesce(avg(CASE WHEN o.rank IS NULL THEN 0.0 ELSE 1.0 / o.rank END), 0),
                  'items', count(o.seq), 'top_k', r2.top_k) AS metrics
              FROM evaluation_runs r2 LEFT JOIN evaluation_run_items o ON o.run_id = r2.id
              WHERE r2.task_id = :task AND r2.status = '{RUNNING}' GROUP BY r2.id, r2.top_k) m
        WHERE r.id = m.id"""
        ),
        {"task": task_id},
    )
    return int(result.rowcount)


async def end_run(conn: AsyncConnection, task_id: uuid.UUID, status: str, reason: str) -> int:
    result = await conn.execute(
        text(
            f"""UPDATE evaluation_runs SET status = :status, error_message = :reason, updated_at = {NOW}
        WHERE task_id = :task AND status = '{RUNNING}'"""
        ),
        {"task": task_id, "status": status, "reason": reason[:2000]},
    )
    return int(result.rowcount)
