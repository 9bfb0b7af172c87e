"""Paused task types: an operator's switch that keeps a type's tasks from being claimed, relayed
or published (the statements read ``paused_types``); running tasks are not touched."""

from __future__ import annotations

from tasks_core.store import statements as sql
from tasks_core.store.base import StoreBase
from tasks_core.store.execute import Rows, run


class Pauses(StoreBase):
    async def pause_type(self, task_type: str, by: str | None) -> bool:
        """Pause ``task_type``; False if it was paused already (the first pause is kept)."""
        async with self.engine.begin() as conn:
            return (await run(conn, sql.PAUSE_TYPE_SQL, self._p(tt=task_type, by=by))).rowcount == 1

    async def resume_type(self, task_type: str) -> bool:
        """Resume ``task_type``; False if it was not paused. The caller publishes what waits."""
        async with self.engine.begin() as conn:
            return (await run(conn, sql.RESUME_TYPE_SQL, {"tt": task_type})).first() is not None

    async def paused_types(self) -> Rows:
        async with self.engine.connect() as conn:
            return [dict(r) for r in (await run(conn, sql.PAUSED_TYPES_SQL)).mappings()]
