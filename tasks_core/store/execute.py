"""How a store statement runs: every statement is a ``Statement`` and runs through one of the two
doors here.

- ``fetch``: one statement on its own, straight through the pooled connection's asyncpg driver
  (claim, the terminal write without hooks, the relay's stamp). It skips SQLAlchemy's
  per-execution work (result metadata, processors, greenlet hops): about 0.3 ms of worker CPU
  per call, three calls per task.
- ``run``: a statement inside a SQLAlchemy connection, for transactions a domain hook shares
  (hooks receive an ``AsyncConnection``) and for everything off the hot path.

Both stay: moving the hot path onto ``run`` costs that CPU, and moving the transactions onto the
driver would change the connection domain hooks write through.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import CursorResult
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql.elements import TextClause
from sqlalchemy.util import greenlet_spawn
from sqlalchemy.util.typing import TupleAny

from tasks_core.db import is_transient

Row = Mapping[str, Any]
Rows = list[Row]


class Statement:
    """A named statement: the SQL text with ``:name`` parameters, as a SQLAlchemy ``clause`` and
    as the driver's positional ``query`` (prepared once per connection by asyncpg)."""

    def __init__(self, clause: TextClause | str) -> None:
        self.clause = text(clause) if isinstance(clause, str) else clause
        self.names: list[str] = []

        def positional(match: re.Match[str]) -> str:
            if match.group(1) not in self.names:
                self.names.append(match.group(1))
            return f"${self.names.index(match.group(1)) + 1}"

        # `:name`, not `::type` (a cast) and not inside a word.
        self.query = re.sub(r"(?<![:\w]):([A-Za-z_]\w*)", positional, self.clause.text)

    @property
    def text(self) -> str:
        return self.clause.text

    def args(self, params: Mapping[str, Any]) -> list[Any]:
        return [params[name] for name in self.names]


async def run(
    conn: AsyncConnection, statement: Statement, params: Mapping[str, Any] | None = None
) -> CursorResult[*TupleAny]:
    """``statement`` on ``conn``, in whatever transaction the caller holds."""
    return await conn.execute(statement.clause, dict(params or {}))


async def fetch(engine: AsyncEngine, statement: Statement, params: Mapping[str, Any]) -> Rows:
    """Run a hot-path statement on its own through the driver; rows as dicts. The driver runs
    it in autocommit (nothing opened a transaction on the connection). The connection comes
    straight from the pool, without an engine Connection around it: its construction, the
    AUTOCOMMIT option's set and reset and its close cost about 45 us of CPU per call."""
    raw = await engine.raw_connection()
    try:
        driver = raw.driver_connection
        assert driver is not None  # a checked-out connection always has its driver's
        try:
            records = await driver.fetch(statement.query, *statement.args(params))
        except Exception as exc:
            if is_transient(exc):
                # SQLAlchemy did not see the failure: drop the connection, never pool it again.
                await greenlet_spawn(raw.invalidate)
            raise
    finally:
        # Back to the pool (closing it, if it was an overflow one, awaits the driver: greenlet).
        await greenlet_spawn(raw.close)
    return [plain_row(r) for r in records]


def plain_row(record: Mapping[str, Any]) -> dict[str, Any]:
    """A driver record as SQLAlchemy would give it: asyncpg's own UUID type becomes uuid.UUID."""
    return {k: plain_uuid(v) if isinstance(v, uuid.UUID) else v for k, v in record.items()}


def plain_uuid(value: uuid.UUID) -> uuid.UUID:
    return value if type(value) is uuid.UUID else uuid.UUID(int=value.int)
