"""Procrastinate's side of the peer benchmark: a no-op and a sleep task on the run's PostgreSQL.

``procrastinate --app tasks_core.devkit.bench.procrastinate_app.app worker`` runs it; the database comes
from ``$DTASK_BENCH_PROCRASTINATE_DSN`` (a libpq URL), set by the bench for its worker process.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import procrastinate

NOOP = "bench_noop"
SLEEP = "bench_sleep"  # `dtask bench density`: a long job that only waits


def make_app(dsn: str) -> Any:
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))

    @app.task(name=NOOP)
    async def noop() -> None:
        return None

    @app.task(name=SLEEP)
    async def sleep(seconds: float) -> None:
        await asyncio.sleep(seconds)

    return app


app = make_app(os.environ.get("DTASK_BENCH_PROCRASTINATE_DSN", ""))
