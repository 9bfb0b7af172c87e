"""Summary counts and keyset listing over more rows than any default page (250 tasks)."""

from __future__ import annotations

import base64
import json
import random
import uuid
from collections import Counter
from datetime import datetime, timedelta
from typing import Any

import pytest
from repo_helpers import db_now
from sqlalchemy import text

from tasks_core.store.facade import TaskStore
from tasks_core.store.reads import encode_cursor

TYPES = ("diagnostics.noop", "diagnostics.sleep", "diagnostics.fail")
STATUSES = ("pending", "running", "success", "failed", "cancelled")
OWNERS = ("alice", "bob")


async def _seed(engine: Any, n: int = 250, *, hours_ago: float = 1.0) -> list[dict[str, Any]]:
    """n tasks of mixed type, status and owner. created_at comes in groups of three equal instants,
    so the id tie-break of the keyset order is exercised on every page."""
    rng = random.Random(250)
    base = await db_now(engine) - timedelta(hours=hours_ago)
    rows = []
    for i in range(n):
        status = rng.choice(STATUSES)
        rows.append(
            {
                "id": uuid.uuid4(),
                "tt": rng.choice(TYPES),
                "status": status,
                "owner": OWNERS[i % 2],
                "created": base + timedelta(milliseconds=i // 3),
                "tok": uuid.uuid4() if status == "running" else None,
                "lease": base + timedelta(hours=2) if status == "running" else None,
                "finished": base + timedelta(minutes=5)
                if status in ("success", "failed", "cancelled")
                else None,
            }
        )
    async with engine.begin() as conn:
        await conn.execute(
            text(
                """INSERT INTO tasks (id, task_type, handler_version, payload, owner, status, attempt_token,
                       lease_expires_at, timeout_seconds, created_at, finished_at)
                VALUES (:id, :tt, 1, CAST('{}' AS jsonb), :owner, :status, :tok, :lease, 60, :created,
                        :finished)"""
            ),
            rows,
        )
    return rows


def _newest_first(rows: list[dict[str, Any]]) -> list[uuid.UUID]:
    # Python orders UUIDs by their 128-bit value, as PostgreSQL does (byte-wise, big-endian).
    return [r["id"] for r in sorted(rows, key=lambda r: (r["created"], r["id"]), reverse=True)]


async def _walk(repo: TaskStore, limit: int, **filters: Any) -> tuple[list[uuid.UUID], int]:
    ids: list[uuid.UUID] = []
    cursor: str | None = None
    pages = 0
    while True:
        items, cursor = await repo.list(limit=limit, cursor=cursor, **filters)
        pages += 1
        assert len(items) <= limit
        assert items or pages == 1, "an empty page after a non-null cursor"
        ids.extend(r["id"] for r in items)
        if cursor is None:
            return ids, pages
        assert len(items) == limit
        assert pages < 100, "paging does not terminate"


async def test_summary_counts_are_exact_beyond_a_page(services: Any) -> None:
    rows = await _seed(services.engine)
    summary = await services.repo.summary()

    assert summary["total"] == 250
    assert summary["by_status"] == {s: Counter(r["status"] for r in rows)[s] for s in STATUSES}
    by_type: dict[str, dict[str, int]] = {}
    for (tt, status), n in Counter((r["tt"], r["status"]) for r in rows).items():
        by_type.setdefault(tt, {})[status] = n
    assert summary["by_type"] == by_type


async def test_summary_of_an_empty_table(services: Any) -> None:
    summary = await services.repo.summary()
    assert summary == {"total": 0, "by_status": dict.fromkeys(STATUSES, 0), "by_type": {}}


async def test_keyset_pages_visit_every_task_once_newest_first(services: Any) -> None:
    rows = await _seed(services.engine)
    ids, pages = await _walk(services.repo, 37)
    assert pages == 7  # 6 * 37 + 28
    assert len(ids) == len(set(ids)) == 250
    assert ids == _newest_first(rows)


async def test_keyset_paging_ends_without_an_empty_page_on_an_exact_multiple(services: Any) -> None:
    rows = await _seed(services.engine)
    ids, pages = await _walk(services.repo, 50)
    assert (pages, ids) == (5, _newest_first(rows))


@pytest.mark.parametrize(
    "filters",
    [
        {"status": "failed"},
        {"status": "running"},
        {"task_type": "diagnostics.sleep"},
        {"status": "pending", "task_type": "diagnostics.noop"},
        {"owner": "alice"},
        {"owner": "bob", "status": "success"},
    ],
    ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()),
)
async def test_filtered_keyset_pages_visit_exactly_the_matching_tasks(
    services: Any, filters: dict[str, str]
) -> None:
    rows = await _seed(services.engine)
    column = {"status": "status", "task_type": "tt", "owner": "owner"}
    expected = [r for r in rows if all(r[column[k]] == v for k, v in filters.items())]
    assert expected, "the seed should produce matches for every filter"
    ids, _ = await _walk(services.repo, 37, **filters)
    assert ids == _newest_first(expected)


async def test_list_of_nothing_is_one_empty_page(services: Any) -> None:
    await _seed(services.engine, 10)
    assert await services.repo.list(status="running", task_type="no.such.type") == ([], None)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


@pytest.mark.parametrize(
    "cursor",
    [
        "not a cursor",
        "%%%%",
        _b64(b"\xff\xfe\xfd"),
        _b64(b"2026-01-01T00:00:00+00:00"),  # no id
        _b64(b"2026-01-01T00:00:00+00:00|not-a-uuid"),
        _b64(f"2026-01-01T00:00:00|{uuid.UUID(int=1)}".encode()),  # naive timestamp
        _b64(f"yesterday|{uuid.UUID(int=2)}".encode()),
        _b64(json.dumps({"created_at": "2026-01-01"}).encode()),
    ],
)
async def test_malformed_cursor_raises_value_error(services: Any, cursor: str) -> None:
    with pytest.raises(ValueError, match="malformed cursor"):
        await services.repo.list(cursor=cursor)


async def test_a_cursor_keeps_its_place_while_new_tasks_arrive(services: Any) -> None:
    """Keyset, not offset: rows inserted ahead of the cursor neither shift nor repeat later pages."""
    rows = await _seed(services.engine, 60)
    first, cursor = await services.repo.list(limit=20)
    await _seed(services.engine, 15, hours_ago=0.5)  # newer than every row already listed
    rest: list[uuid.UUID] = []
    while cursor:
        items, cursor = await services.repo.list(limit=20, cursor=cursor)
        rest.extend(r["id"] for r in items)
    assert [r["id"] for r in first] + rest == _newest_first(rows)


def test_cursor_round_trips_microseconds() -> None:
    from tasks_core.store.reads import decode_cursor

    stamp = datetime(2026, 3, 4, 5, 6, 7, 891011).astimezone()
    ident = uuid.uuid4()
    assert decode_cursor(encode_cursor(stamp, ident)) == (stamp, ident)


@pytest.mark.parametrize("limit", [0, -1])
async def test_list_rejects_a_limit_below_one(services: Any, limit: int) -> None:
    await _seed(services.engine, 3)
    with pytest.raises(ValueError, match="limit"):
        await services.repo.list(limit=limit)


async def test_summary_of_one_owner_counts_only_their_tasks(services: Any) -> None:
    rows = await _seed(services.engine)
    mine = [r for r in rows if r["owner"] == "alice"]
    summary = await services.repo.summary(owner="alice")
    assert summary["total"] == len(mine) == 125
    assert summary["by_status"] == {s: Counter(r["status"] for r in mine)[s] for s in STATUSES}
    assert (await services.repo.summary(owner="nobody"))["total"] == 0


async def test_oldest_pending_age_is_measured_on_the_database_clock(services: Any) -> None:
    assert await services.repo.oldest_pending_age() is None
    rows = await _seed(services.engine, 30)
    oldest = min(r["created"] for r in rows if r["status"] == "pending")
    pinned = oldest + timedelta(seconds=90)
    assert await TaskStore(services.engine, now=pinned).oldest_pending_age() == 90.0
