"""The transitions that take a task out of running, for a caller holding its row locked: to a
terminal status (by someone other than its owner) and back to pending."""

from __future__ import annotations

import json
import logging
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from tasks_core.model import Status
from tasks_core.store import statements as sql
from tasks_core.store.base import StoreBase, terminal_params
from tasks_core.store.execute import Row, run
from tasks_core.store.outcomes import HookSource

log = logging.getLogger(__name__)


class Transitions(StoreBase):
    async def _terminal(
        self,
        conn: AsyncConnection,
        row: Row,
        status: Status,
        *,
        result: Any = None,
        error: dict[str, str] | None = None,
        outcome: str,
        detail: str | None = None,
    ) -> None:
        await run(
            conn,
            sql.CONVERGE_SQL,
            self._p(
                id=row["id"],
                tok=row["attempt_token"],
                lease=row["lease_expires_at"],
                **terminal_params(status, outcome=outcome, detail=detail, result=result, error=error),
            ),
        )

    async def _to_pending(
        self,
        conn: AsyncConnection,
        row: Row,
        *,
        outcome: str,
        delay: float,
        detail: str | None = None,
        message: str | None = None,
    ) -> None:
        await run(
            conn,
            sql.TO_PENDING_SQL,
            self._p(
                id=row["id"],
                tok=row["attempt_token"],
                lease=row["lease_expires_at"],
                status=Status.PENDING.value,
                outcome=outcome,
                detail=detail,
                delay=delay,
                message=message,
            ),
        )

    async def _run_hook(self, conn: AsyncConnection, hooks: HookSource, row: Row, status: Status) -> None:
        kind = "success" if status == Status.SUCCESS else "failure"
        hook = hooks.hook_for(row["task_type"], row["handler_version"], kind)
        if hook is not None:
            await hook(conn, row, status.value)

    async def _converge(
        self, conn: AsyncConnection, row: Row, status: Status, error: dict[str, str], hooks: HookSource | None
    ) -> bool:
        """Terminal transition by someone other than the owner; False if the hook failed.

        A failing hook is rolled back to a savepoint and the task still ends, without it, so one
        broken hook cannot keep a task (or the batch behind it) from converging.
        """
        await self._terminal(conn, row, status, error=error, outcome=error["code"])
        if hooks is None:
            return True
        try:
            async with conn.begin_nested():
                await self._run_hook(conn, hooks, row, status)
        except Exception as exc:  # a domain hook may raise anything
            log.exception("failure hook of task %s (%s) raised", row["id"], row["task_type"])
            await run(
                conn,
                sql.SET_ERROR_SQL,
                {
                    "id": row["id"],
                    "error": json.dumps(
                        {**error, "message": f"{error['message']}; failure hook raised: {exc!r}"[:1000]}
                    ),
                },
            )
            return False
        return True
