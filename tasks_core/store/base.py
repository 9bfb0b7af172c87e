"""What every part of the task store shares: the engine, the pinned "now", and the two ways a
statement runs (see execute)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from tasks_core.model import Status
from tasks_core.store import execute
from tasks_core.store.execute import Row, Rows, Statement, plain_uuid
from tasks_core.store.outcomes import Finished, RunnableSource

# The error a success becomes when cancel intent beat it.
CANCELLED_ERROR = json.dumps({"code": "cancelled", "message": "cancel requested"})


class StoreBase:
    def __init__(self, engine: AsyncEngine, *, now: datetime | None = None) -> None:
        self.engine = engine
        self._auto = engine.execution_options(isolation_level="AUTOCOMMIT")
        self.now = now
        self._slots = 0  # capacity slots known to exist

    def _p(self, **params: Any) -> dict[str, Any]:
        return {"now": self.now, **params}

    def _autocommit(self) -> Any:
        """A pooled connection without BEGIN/COMMIT round trips, for single-statement writes."""
        return self._auto.connect()

    async def _fetch(self, statement: Statement, params: Mapping[str, Any]) -> Rows:
        """A hot-path statement on its own, through the driver (see execute.fetch)."""
        return await execute.fetch(self.engine, statement, params)


def terminal_params(
    status: Status, *, outcome: str, detail: str | None, result: Any, error: dict[str, str] | None
) -> dict[str, Any]:
    """The parameters of the terminal transition (statements.TERMINAL_SET and end_attempt)."""
    return {
        "status": status.value,
        "outcome": outcome,
        "detail": detail,
        "result": None if result is None else json.dumps(result),
        "error": None if error is None else json.dumps(error),
        "cancelled": CANCELLED_ERROR,
    }


def runnable_arrays(registry: RunnableSource) -> dict[str, list[Any]]:
    specs = registry.specs()  # type: ignore[attr-defined]
    return {"types": [s.task_type for s in specs], "versions": [s.version for s in specs]}


def type_caps(registry: RunnableSource) -> dict[str, list[Any]]:
    capped = [s for s in registry.specs() if s.concurrency is not None]  # type: ignore[attr-defined]
    return {"ctypes": [s.task_type for s in capped], "ccaps": [s.concurrency for s in capped]}


def finished(row: Row) -> Finished:
    ids, types = row.get("relay_ids") or [], row.get("relay_types") or []
    return Finished(Status(row["status"]), [(plain_uuid(i), t) for i, t in zip(ids, types, strict=True)])
