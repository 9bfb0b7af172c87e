"""The knowledge domain's SQL: bases, files and chunk texts (the runtime's own SQL stays in tasks_core).

Reads return plain dicts. Writes by a task go through the handler's owning transaction and are
fenced twice: the runtime checks the task's attempt token and lease, and every statement here that
moves a file on also names the task and attempt that own it, so a late write matches no row.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from domains.knowledge.model import (
    ATTEMPT_BOUND,
    ERROR_INDEXING,
    ERROR_PARSING,
    IN_PROGRESS,
    UPLOADED,
)
from tasks_core import cursor as keyset
from tasks_core.model import sql_in

Row = dict[str, Any]
NOW = "clock_timestamp()"
_ACTIVE = "('pending', 'running')"
_IN_PROGRESS = sql_in(IN_PROGRESS)
_BOUND = sql_in(ATTEMPT_BOUND)


def new_id() -> str:
    return uuid.uuid4().hex


# ------------------------------------------------------------------------------------------------ bases


async def insert_base(conn: AsyncConnection, owner: str, name: str, embedder: str, dimension: int) -> Row:
    row = (
        (
            await conn.execute(
                text(
                    """INSERT INTO knowledge_bases (id, owner, name, embedder, dimension)
        VALUES (:id, :owner, :name, :embedder, :dim)
        ON CONFLICT (owner, name) DO NOTHING RETURNING *"""
                ),
                {"id": new_id(), "owner": owner, "name": name, "embedder": embedder, "dim": dimension},
            )
        )
        .mappings()
        .first()
    )
    return dict(row) if row else {}


async def get_base(conn: AsyncConnection, base_id: str) -> Row | None:
    row = (
        (await conn.execute(text("SELECT * FROM knowledge_bases WHERE id = :id"), {"id": base_id}))
        .mappings()
        .first()
    )
    return None if row is None else dict(row)


async def list_bases(conn: AsyncConnection, owner: str | None) -> list[Row]:
    rows = (
        (
            await conn.execute(
                text(
                    """SELECT b.*, coalesce((SELECT jsonb_object_agg(status, n) FROM (
                SELECT status, count(*) AS n FROM knowledge_files f WHERE f.kb_id = b.id GROUP BY status) s),
                '{}'::jsonb) AS file_counts
        FROM knowledge_bases b WHERE CAST(:owner AS text) IS NULL OR b.owner = :owner
        ORDER BY b.created_at DESC, b.id"""
                ),
                {"owner": owner},
            )
        )
        .mappings()
        .all()
    )
    return [dict(r) for r in rows]


async def file_counts(conn: AsyncConnection, base_id: str) -> dict[str, int]:
    rows = (
        await conn.execute(
            text("SELECT status, count(*) FROM knowledge_files WHERE kb_id = :id GROUP BY status"),
            {"id": base_id},
        )
    ).all()
    return {status: int(n) for status, n in rows}


async def delete_base(conn: AsyncConnection, base_id: str) -> None:
    # Files and chunks go with it (ON DELETE CASCADE).
    await conn.execute(text("DELETE FROM knowledge_bases WHERE id = :id"), {"id": base_id})


async def active_tasks_of_base(conn: AsyncConnection, base_id: str) -> list[uuid.UUID]:
    rows = (
        await conn.execute(
            text(
                f"""SELECT DISTINCT t.id FROM knowledge_files f JOIN tasks t ON t.id = f.task_id
        WHERE f.kb_id = :id AND t.status IN {_ACTIVE}"""
            ),
            {"id": base_id},
        )
    ).all()
    return [r[0] for r in rows]


# ------------------------------------------------------------------------------------------------ files


async def insert_files(conn: AsyncConnection, rows: Sequence[Row]) -> None:
    """File rows as given (``uploaded`` unless a row says otherwise; no content hash unless given)."""
    if rows:
        await conn.execute(
            text(
                """INSERT INTO knowledge_files
                   (file_id, kb_id, filename, file_type, size_bytes, status, error_message, content_hash,
                    task_id, refused_at_upload)
            VALUES (:file_id, :kb_id, :filename, :file_type, :size_bytes, :status, :error_message,
                    :content_hash, :task_id, :refused_at_upload)"""
            ),
            [
                {"status": UPLOADED, "error_message": None, "content_hash": None, "refused_at_upload": False}
                | dict(r)
                for r in rows
            ],
        )


async def insert_new_contents(conn: AsyncConnection, rows: Sequence[Row]) -> set[str]:
    """Insert ``uploaded`` file rows (no task yet) whose content is new to their base; the ids of
    those inserted. A row whose ``content_hash`` the base already has (committed, or in a
    concurrent transaction, which this waits for) is skipped: the unique index decides, so two
    uploads of the same bytes at once end as one file. Rows go in hash order, so two requests with
    the same files in other orders wait for each other instead of deadlocking."""
    if not rows:
        return set()
    ordered = sorted(rows, key=lambda r: str(r["content_hash"]))
    inserted = await conn.execute(
        text(
            """INSERT INTO knowledge_files (file_id, kb_id, filename, file_type, size_bytes, content_hash)
        SELECT u.file_id, u.kb_id, u.filename, u.file_type, u.size_bytes, u.content_hash
        FROM unnest(CAST(:ids AS text[]), CAST(:kbs AS text[]), CAST(:names AS text[]),
                    CAST(:types AS text[]), CAST(:sizes AS bigint[]), CAST(:hashes AS text[]))
             WITH ORDINALITY AS u(file_id, kb_id, filename, file_type, size_bytes, content_hash, n)
        ORDER BY u.n
        ON CONFLICT (kb_id, content_hash) DO NOTHING RETURNING file_id"""
        ),
        {
            "ids": [r["file_id"] for r in ordered],
            "kbs": [r["kb_id"] for r in ordered],
            "names": [r["filename"] for r in ordered],
            "types": [r["file_type"] for r in ordered],
            "sizes": [r["size_bytes"] for r in ordered],
            "hashes": [r["content_hash"] for r in ordered],
        },
    )
    return {r[0] for r in inserted}


async def files_by_hash(conn: AsyncConnection, base_id: str, hashes: Sequence[str]) -> dict[str, Row]:
    """The base's files with these content hashes, by hash."""
    rows = (
        (
            await conn.execute(
                text(
                    """SELECT file_id, filename, status, task_id, content_hash FROM knowledge_files
        WHERE kb_id = :kb AND content_hash = ANY(:hashes)"""
                ),
                {"kb": base_id, "hashes": list(hashes)},
            )
        )
        .mappings()
        .all()
    )
    return {r["content_hash"]: dict(r) for r in rows}


async def hand_to_tasks(conn: AsyncConnection, tasks: dict[str, uuid.UUID]) -> None:
    """Name each new file's ingest task (file id -> task id), in the transaction that made both."""
    if tasks:
        await conn.execute(
            text(
                """UPDATE knowledge_files f SET task_id = u.task_id
        FROM unnest(CAST(:ids AS text[]), CAST(:tasks AS uuid[])) AS u(file_id, task_id)
        WHERE f.file_id = u.file_id"""
            ),
            {"ids": list(tasks), "tasks": list(tasks.values())},
        )


async def get_file(conn: AsyncConnection, file_id: str, *, lock: bool = False) -> Row | None:
    """The file with its base's owner and embedder, and whether its task is still active."""
    row = (
        (
            await conn.execute(
                text(
                    f"""SELECT f.*, b.owner, b.embedder, b.dimension, t.status IN {_ACTIVE} AS task_active,
               t.status AS task_status, t.task_type, t.attempt_count AS task_attempts
        FROM knowledge_files f JOIN knowledge_bases b ON b.id = f.kb_id
        LEFT JOIN tasks t ON t.id = f.task_id WHERE f.file_id = :id"""
                    + (" FOR UPDATE OF f" if lock else "")
                ),
                {"id": file_id},
            )
        )
        .mappings()
        .first()
    )
    return None if row is None else dict(row)


def encode_cursor(created_at: datetime, file_id: str) -> str:
    return keyset.encode_cursor(created_at, file_id)


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    return keyset.decode_cursor(cursor, str)


async def list_files(
    conn: AsyncConnection, base_id: str, *, status: str | None, limit: int, cursor: str | None
) -> tuple[list[Row], str | None]:
    """Newest first, keyset-paged on (created_at, file_id); with the status, type and attempts so
    far of each file's task (None once the task is pruned)."""
    after = decode_cursor(cursor) if cursor else (None, None)
    rows = (
        (
            await conn.execute(
                text(
                    """SELECT f.*, t.status AS task_status, t.task_type, t.attempt_count AS task_attempts
        FROM knowledge_files f LEFT JOIN tasks t ON t.id = f.task_id WHERE f.kb_id = :kb
          AND (CAST(:status AS text) IS NULL OR f.status = :status)
          AND (CAST(:c_at AS timestamptz) IS NULL
               OR (f.created_at, f.file_id) < (CAST(:c_at AS timestamptz), :c_id))
        ORDER BY f.created_at DESC, f.file_id DESC LIMIT :limit"""
                ),
                {
                    "kb": base_id,
                    "status": status,
                    "c_at": after[0],
                    "c_id": after[1] or "",
                    "limit": limit + 1,
                },
            )
        )
        .mappings()
        .all()
    )
    items = [dict(r) for r in rows[:limit]]
    nxt = encode_cursor(items[-1]["created_at"], items[-1]["file_id"]) if len(rows) > limit else None
    return items, nxt


async def delete_file(conn: AsyncConnection, file_id: str) -> None:
    await conn.execute(text("DELETE FROM knowledge_files WHERE file_id = :id"), {"id": file_id})


async def assign(conn: AsyncConnection, file_ids: Sequence[str], task_id: uuid.UUID) -> None:
    """Hand files to a new task: queued again (``uploaded``), last verdict cleared."""
    await conn.execute(
        text(
            f"""UPDATE knowledge_files SET task_id = :task, attempt_token = NULL, status = '{UPLOADED}',
               error_message = NULL, updated_at = {NOW}
        WHERE file_id = ANY(:ids)"""
        ),
        {"task": task_id, "ids": list(file_ids)},
    )


def refused_at_upload(row: Row) -> bool:
    """Recorded error_parsing at upload: no original was kept, so no task can ever parse it;
    delete it and upload a file that can be."""
    return bool(row["refused_at_upload"])


async def reindexable(conn: AsyncConnection, base_id: str) -> list[str]:
    """Files of a base waiting for work no task will do: errored, or uploaded under a finished task
    (not those refused at upload: there is nothing to parse)."""
    rows = (
        await conn.execute(
            text(
                f"""SELECT f.file_id FROM knowledge_files f LEFT JOIN tasks t ON t.id = f.task_id
        WHERE f.kb_id = :kb AND (t.id IS NULL OR t.status NOT IN {_ACTIVE})
          AND f.status IN ('{ERROR_PARSING}', '{ERROR_INDEXING}', '{UPLOADED}') AND NOT f.refused_at_upload
        ORDER BY f.created_at, f.file_id FOR UPDATE OF f"""
            ),
            {"kb": base_id},
        )
    ).all()
    return [r[0] for r in rows]


# ------------------------------------------------------------------------------------------------ by a task


async def owned_in_progress(conn: AsyncConnection, task_id: uuid.UUID) -> list[str]:
    """The files this task still has to finish: uploaded ones, and any an earlier attempt of it left
    in progress."""
    rows = (
        await conn.execute(
            text(
                f"""SELECT file_id FROM knowledge_files WHERE task_id = :task AND status IN {_IN_PROGRESS}
        ORDER BY created_at, file_id"""
            ),
            {"task": task_id},
        )
    ).all()
    return [r[0] for r in rows]


async def others_in_progress(conn: AsyncConnection, task_id: uuid.UUID, file_id: str) -> bool:
    """Whether the task still has files in progress besides this one."""
    row = await conn.execute(
        text(
            f"""SELECT 1 FROM knowledge_files WHERE task_id = :task AND file_id <> :id
        AND status IN {_IN_PROGRESS} LIMIT 1"""
        ),
        {"task": task_id, "id": file_id},
    )
    return row.first() is not None


async def start(conn: AsyncConnection, file_id: str, task_id: uuid.UUID, token: uuid.UUID) -> Row | None:
    """``start_many`` of one file: its row (with its base's embedder and dimension and its chunk-row
    count) if the task owns it, else None."""
    rows = await start_many(conn, [file_id], task_id, token)
    return rows[0] if rows else None


async def start_many(
    conn: AsyncConnection, file_ids: Sequence[str], task_id: uuid.UUID, token: uuid.UUID
) -> list[Row]:
    """``start`` for several files of one task in one statement: the rows of those it owns (in the
    order given), each with its base's embedder and dimension and its chunk-row count."""
    rows = (
        (
            await conn.execute(
                text(
                    f"""UPDATE knowledge_files f
                SET status = 'parsing', attempt_token = :tok, error_message = NULL,
               updated_at = {NOW}
        FROM knowledge_bases b
        WHERE f.file_id = ANY(:ids) AND f.task_id = :task AND f.status IN {_IN_PROGRESS} AND b.id = f.kb_id
        RETURNING f.*, b.embedder, b.dimension,
            (SELECT count(*) FROM knowledge_chunks c WHERE c.file_id = f.file_id) AS chunk_rows"""
                ),
                {"ids": list(file_ids), "task": task_id, "tok": token},
            )
        )
        .mappings()
        .all()
    )
    by_id = {r["file_id"]: dict(r) for r in rows}
    return [by_id[f] for f in dict.fromkeys(file_ids) if f in by_id]


async def advance_many(
    conn: AsyncConnection,
    file_ids: Sequence[str],
    task_id: uuid.UUID,
    token: uuid.UUID,
    expect: str,
    to: str,
    chunk_counts: Sequence[int] | None = None,
) -> set[str]:
    """``advance`` for several files in one statement (with ``chunk_counts``, each file's count is
    set, and its error message cleared); the ids of those this attempt moved."""
    if not file_ids:
        return set()
    counts = list(chunk_counts) if chunk_counts is not None else [None] * len(file_ids)
    result = await conn.execute(
        text(
            f"""UPDATE knowledge_files f SET status = :to, updated_at = {NOW},
               chunk_count = coalesce(u.chunks, f.chunk_count),
               error_message = CASE WHEN u.chunks IS NULL THEN f.error_message END
        FROM unnest(CAST(:ids AS text[]), CAST(:counts AS integer[])) AS u(file_id, chunks)
        WHERE f.file_id = u.file_id AND f.task_id = :task AND f.attempt_token = :tok
          AND f.status = :expect
        RETURNING f.file_id"""
        ),
        {"ids": list(file_ids), "counts": counts, "task": task_id, "tok": token, "expect": expect, "to": to},
    )
    return {r[0] for r in result}


async def fail_many(
    conn: AsyncConnection, failures: dict[str, tuple[str, str]], task_id: uuid.UUID, token: uuid.UUID
) -> set[str]:
    """End files in error states (file id -> (state, message)) as their owning attempt; the ids
    this attempt failed."""
    if not failures:
        return set()
    result = await conn.execute(
        text(
            f"""UPDATE knowledge_files f SET status = u.state, error_message = u.msg, updated_at = {NOW}
        FROM unnest(CAST(:ids AS text[]), CAST(:states AS text[]), CAST(:msgs AS text[]))
             AS u(file_id, state, msg)
        WHERE f.file_id = u.file_id AND f.task_id = :task AND f.attempt_token = :tok
          AND f.status IN {_BOUND}
        RETURNING f.file_id"""
        ),
        {
            "ids": list(failures),
            "states": [state for state, _ in failures.values()],
            "msgs": [message[:2000] for _, message in failures.values()],
            "task": task_id,
            "tok": token,
        },
    )
    return {r[0] for r in result}


async def note_many(
    conn: AsyncConnection, file_ids: Sequence[str], task_id: uuid.UUID, token: uuid.UUID, message: str
) -> set[str]:
    """Say on files in progress why they wait (their states stay); the ids of those this attempt
    still holds."""
    result = await conn.execute(
        text(
            f"""UPDATE knowledge_files SET error_message = :msg, updated_at = {NOW}
        WHERE file_id = ANY(:ids) AND task_id = :task AND attempt_token = :tok AND status IN {_BOUND}
        RETURNING file_id"""
        ),
        {"ids": list(file_ids), "task": task_id, "tok": token, "msg": message[:2000]},
    )
    return {r[0] for r in result}


async def advance(
    conn: AsyncConnection,
    file_id: str,
    task_id: uuid.UUID,
    token: uuid.UUID,
    expect: str,
    to: str,
    **values: Any,
) -> bool:
    """Move the file from ``expect`` to ``to`` as its owning attempt; False if that is not us."""
    sets = "".join(f", {name} = :v_{name}" for name in values)
    result = await conn.execute(
        text(
            f"""UPDATE knowledge_files SET status = :to, updated_at = {NOW}{sets}
        WHERE file_id = :id AND task_id = :task AND attempt_token = :tok AND status = :expect"""
        ),
        {
            "id": file_id,
            "task": task_id,
            "tok": token,
            "expect": expect,
            "to": to,
            **{f"v_{k}": v for k, v in values.items()},
        },
    )
    return bool(result.rowcount)


async def replace_chunks_many(
    conn: AsyncConnection, token: uuid.UUID, files: Sequence[tuple[str, Sequence[str], Sequence[str]]]
) -> None:
    """``replace_chunks`` for several files (file id, chunk ids, texts) in two statements."""
    if not files:
        return
    await conn.execute(
        text("DELETE FROM knowledge_chunks WHERE file_id = ANY(:ids)"), {"ids": [f for f, _, _ in files]}
    )
    rows = [(f, c, i, t) for f, ids, texts in files for i, (c, t) in enumerate(zip(ids, texts, strict=True))]
    if rows:
        await conn.execute(
            text(
                """INSERT INTO knowledge_chunks (chunk_id, file_id, seq, text, attempt_token)
            SELECT u.chunk_id, u.file_id, u.seq, u.text, :tok
            FROM unnest(CAST(:chunk_ids AS text[]), CAST(:file_ids AS text[]), CAST(:seqs AS integer[]),
                        CAST(:texts AS text[])) AS u(chunk_id, file_id, seq, text)"""
            ),
            {
                "chunk_ids": [r[1] for r in rows],
                "file_ids": [r[0] for r in rows],
                "seqs": [r[2] for r in rows],
                "texts": [r[3] for r in rows],
                "tok": token,
            },
        )


async def task_outcome(
    conn: AsyncConnection, task_id: uuid.UUID, max_errors: int
) -> tuple[dict[str, int], dict[str, str]]:
    """The task's files counted by status, and up to ``max_errors`` of those in an error state with
    their messages."""
    counts = {
        status: int(n)
        for status, n in (
            await conn.execute(
                text("SELECT status, count(*) FROM knowledge_files WHERE task_id = :task GROUP BY status"),
                {"task": task_id},
            )
        ).all()
    }
    errors = (
        await conn.execute(
            text(
                f"""SELECT file_id, error_message FROM knowledge_files
        WHERE task_id = :task AND status IN ('{ERROR_PARSING}', '{ERROR_INDEXING}')
        ORDER BY created_at, file_id LIMIT :n"""
            ),
            {"task": task_id, "n": max_errors},
        )
    ).all()
    return counts, {file_id: message or "" for file_id, message in errors}


async def converge(conn: AsyncConnection, task_id: uuid.UUID, reason: str) -> int:
    """Terminal hook: every file this task still holds in progress takes its error state (I6)."""
    result = await conn.execute(
        text(
            f"""UPDATE knowledge_files SET
               status = CASE WHEN status IN ('uploaded', 'parsing') THEN '{ERROR_PARSING}'
                             ELSE '{ERROR_INDEXING}' END,
               error_message = CASE WHEN status IN ('uploaded', 'parsing') THEN 'not parsed: '
                                    ELSE 'not indexed: ' END || :reason,
               updated_at = {NOW}
        WHERE task_id = :task AND status IN {_IN_PROGRESS}"""
        ),
        {"task": task_id, "reason": reason[:1900]},
    )
    return int(result.rowcount)


# ------------------------------------------------------------------------------------------------ search


async def indexed_chunks(conn: AsyncConnection, base_id: str, chunk_ids: Sequence[str]) -> dict[str, Row]:
    """Texts (and file names) of these chunks whose file is indexed in this base (stale vectors
    find nothing here)."""
    rows = (
        (
            await conn.execute(
                text(
                    """SELECT c.chunk_id, c.file_id, f.filename, c.text FROM knowledge_chunks c
        JOIN knowledge_files f ON f.file_id = c.file_id
        WHERE c.chunk_id = ANY(:ids) AND f.kb_id = :kb AND f.status = 'indexed'"""
                ),
                {"ids": list(chunk_ids), "kb": base_id},
            )
        )
        .mappings()
        .all()
    )
    return {r["chunk_id"]: dict(r) for r in rows}


# ------------------------------------------------------------------------------------------------ verifier


async def base_ids_after(conn: AsyncConnection, after: str, limit: int) -> list[Row]:
    """Bases in id order after ``after`` (the verifier's round-robin), with their owners."""
    rows = (
        await conn.execute(
            text("SELECT id, owner FROM knowledge_bases WHERE id > :after ORDER BY id LIMIT :n"),
            {"after": after, "n": limit},
        )
    ).mappings()
    return [dict(r) for r in rows]


async def existing_bases(conn: AsyncConnection, base_ids: Sequence[str]) -> set[str]:
    rows = await conn.execute(
        text("SELECT id FROM knowledge_bases WHERE id = ANY(:ids)"), {"ids": list(base_ids)}
    )
    return {r[0] for r in rows}


async def existing_files(conn: AsyncConnection, file_ids: Sequence[str]) -> set[str]:
    rows = await conn.execute(
        text("SELECT file_id FROM knowledge_files WHERE file_id = ANY(:ids)"), {"ids": list(file_ids)}
    )
    return {r[0] for r in rows}


async def files_to_verify(conn: AsyncConnection, base_id: str) -> list[Row]:
    """Every file of the base with what PostgreSQL holds for it: its chunk rows counted, and whether
    a task is working on it (then it is not judged)."""
    rows = (
        await conn.execute(
            text(
                f"""SELECT f.file_id, f.filename, f.status, f.chunk_count, f.updated_at,
               (SELECT count(*) FROM knowledge_chunks c WHERE c.file_id = f.file_id) AS chunk_rows,
               coalesce(t.status IN {_ACTIVE}, false) AS task_active
        FROM knowledge_files f LEFT JOIN tasks t ON t.id = f.task_id WHERE f.kb_id = :kb"""
            ),
            {"kb": base_id},
        )
    ).mappings()
    return [dict(r) for r in rows]


# A verdict is acted on only while the file is as the verifier saw it: same state, not touched since,
# no active task (a reindex that began meanwhile owns the file now).
_UNCHANGED = f"""f.file_id = :id AND f.status = :status AND f.updated_at = :seen
    AND NOT EXISTS (SELECT 1 FROM tasks t WHERE t.id = f.task_id AND t.status IN {_ACTIVE})"""


async def unchanged(conn: AsyncConnection, file_id: str, status: str, seen: datetime) -> bool:
    row = await conn.execute(
        text(f"SELECT 1 FROM knowledge_files f WHERE {_UNCHANGED} FOR UPDATE OF f"),
        {"id": file_id, "status": status, "seen": seen},
    )
    return row.first() is not None


async def lose_original(conn: AsyncConnection, file_id: str, seen: datetime, message: str) -> bool:
    """An indexed file whose original is gone ends error_parsing (it cannot be reindexed), its chunk
    rows removed; False if the file changed since it was seen."""
    result = await conn.execute(
        text(
            f"""UPDATE knowledge_files f SET status = '{ERROR_PARSING}', error_message = :msg,
               chunk_count = 0, updated_at = {NOW}
        WHERE {_UNCHANGED}"""
        ),
        {"id": file_id, "status": "indexed", "seen": seen, "msg": message},
    )
    if not result.rowcount:
        return False
    await conn.execute(text("DELETE FROM knowledge_chunks WHERE file_id = :id"), {"id": file_id})
    return True


async def drop_chunks(conn: AsyncConnection, file_id: str) -> int:
    result = await conn.execute(text("DELETE FROM knowledge_chunks WHERE file_id = :id"), {"id": file_id})
    return int(result.rowcount)
