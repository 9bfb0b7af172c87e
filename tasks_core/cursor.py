"""The keyset cursor of every newest-first listing: ``(created_at, key)`` as opaque URL-safe text.

A page ends at its last row; the next page starts strictly below that row's (created_at, key).
Decoding rejects anything this module did not make with ``ValueError("malformed cursor")``, which
the API answers as a 422 on the ``cursor`` query parameter.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TypeVar

K = TypeVar("K")


def encode_cursor(created_at: datetime, key: object) -> str:
    raw = f"{created_at.isoformat()}|{key}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str, key: Callable[[str], K]) -> tuple[datetime, K]:
    """(created_at in UTC, ``key`` applied to the stored key); ``key`` raises ValueError for a key
    it does not accept."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        stamp, _, ident = raw.partition("|")
        created = datetime.fromisoformat(stamp)
        if created.tzinfo is None or not ident:
            raise ValueError("incomplete cursor")
        # In UTC, or it is no instant PostgreSQL can hold (year 1 at +23:59 overflows).
        return created.astimezone(UTC), key(ident)
    except (ValueError, OverflowError, UnicodeDecodeError, binascii.Error) as exc:
        raise ValueError("malformed cursor") from exc
