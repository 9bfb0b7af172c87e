"""One keyset cursor codec for every listing: the task list and the knowledge file list reject the
same bad cursors with the same error, which the API answers as a 422 on `cursor`."""

from __future__ import annotations

import base64
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from domains.knowledge import catalog
from tasks_core import cursor
from tasks_core.store.reads import decode_cursor


def _b64(raw: str) -> str:
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


BAD = [
    _b64(f"0001-01-01T00:00:00+23:59|{uuid.UUID(int=0)}"),  # before year 1 in UTC: overflows
    _b64("2026-01-01T00:00:00|f-1"),  # naive timestamp
    _b64("2026-01-01T00:00:00+00:00|"),  # no key
    _b64("yesterday|f-1"),
    "%%%",
    base64.urlsafe_b64encode(b"\xff\xfe").decode(),
]


@pytest.mark.parametrize("bad", BAD)
def test_task_list_and_file_list_refuse_a_bad_cursor_alike(bad: str) -> None:
    with pytest.raises(ValueError, match=r"^malformed cursor$"):
        decode_cursor(bad)
    with pytest.raises(ValueError, match=r"^malformed cursor$"):
        catalog.decode_cursor(bad)


class _NoDatabase:
    async def execute(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a malformed cursor must be refused before any query")


@pytest.mark.parametrize("bad", BAD[:2])
async def test_file_list_refuses_an_overflowing_cursor_before_querying(bad: str) -> None:
    # The route turns this ValueError into the same 422 the task list answers.
    with pytest.raises(ValueError, match=r"^malformed cursor$"):
        await catalog.list_files(_NoDatabase(), "kb-1", status=None, limit=10, cursor=bad)  # type: ignore[arg-type]


def test_a_decoded_stamp_is_the_same_instant_in_utc() -> None:
    stamp = datetime(2026, 3, 4, 5, 6, 7, 891011, tzinfo=timezone(timedelta(hours=5, minutes=30)))
    at, key = catalog.decode_cursor(catalog.encode_cursor(stamp, "file-7"))
    assert (at, key) == (stamp, "file-7") and at.tzinfo is UTC
    assert cursor.decode_cursor(cursor.encode_cursor(stamp, 42), int) == (stamp, 42)
