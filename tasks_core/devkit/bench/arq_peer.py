"""arq's side of the peer benchmark, run with the peers venv's python (arq pins redis<6).

    python arq_peer.py worker       # an arq worker: max_jobs from $DTASK_BENCH_ARQ_MAX_JOBS, else defaults
    python arq_peer.py enqueue N    # N no-op jobs through arq's client; prints {"started": time.time()}
    python arq_peer.py enqueue N S  # N jobs that each count their start, then sleep S seconds (density)
    python arq_peer.py latency N    # N no-ops one at a time; prints {"running_ms": [...]} (latency)

Redis from ``$DTASK_BENCH_ARQ_REDIS``. Imports only arq and the standard library, so it runs without
the project installed. Each job counts itself and keeps the latest completion time in Redis (the same
bookkeeping as the plain Celery baseline), which is how the bench knows when all N are done.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

DONE_KEY = "dtask:bench:arq:done"
LAST_KEY = "dtask:bench:arq:last"
STARTED_KEY = "dtask:bench:arq:started"
_DONE_LUA = """
redis.call('INCR', KEYS[1])
local last = redis.call('GET', KEYS[2])
if (not last) or tonumber(ARGV[1]) > tonumber(last) then redis.call('SET', KEYS[2], ARGV[1]) end
return 1
"""


async def noop(ctx: dict[str, Any]) -> None:
    await ctx["redis"].eval(_DONE_LUA, 2, DONE_KEY, LAST_KEY, repr(time.time()))


async def sleep(ctx: dict[str, Any], seconds: float) -> None:
    await ctx["redis"].incr(STARTED_KEY)
    await asyncio.sleep(seconds)


def _redis_settings() -> Any:
    from arq.connections import RedisSettings

    return RedisSettings.from_dsn(os.environ["DTASK_BENCH_ARQ_REDIS"])


async def _enqueue(n: int, sleep_seconds: float | None) -> None:
    from arq import create_pool

    pool = await create_pool(_redis_settings())
    started = time.time()
    for _ in range(n):
        if sleep_seconds is None:
            await pool.enqueue_job("noop")
        else:
            await pool.enqueue_job("sleep", sleep_seconds)
    await pool.aclose()
    sys.stdout.write(json.dumps({"started": started}))


async def _latency(n: int) -> None:
    """Enqueue one no-op, wait until it has run, again: enqueue -> the job's own time stamp, in ms."""
    from arq import create_pool

    pool = await create_pool(_redis_settings())
    running: list[float] = []
    for _ in range(n):
        before = int(await pool.get(DONE_KEY) or 0)
        started = time.time()
        await pool.enqueue_job("noop")
        # The worker is another process: its count in Redis is the only signal there is.
        while int(await pool.get(DONE_KEY) or 0) <= before:  # noqa: ASYNC110
            await asyncio.sleep(0.002)
        running.append((float(await pool.get(LAST_KEY)) - started) * 1000)
    await pool.aclose()
    sys.stdout.write(json.dumps({"running_ms": running}))


def main(argv: list[str]) -> None:
    if argv[:1] == ["enqueue"]:
        asyncio.run(_enqueue(int(argv[1]), float(argv[2]) if len(argv) > 2 else None))
    elif argv[:1] == ["latency"]:
        asyncio.run(_latency(int(argv[1])))
    elif argv[:1] == ["worker"]:
        from arq.worker import run_worker

        class WorkerSettings:
            functions = [noop, sleep]
            redis_settings = _redis_settings()
            max_jobs = int(os.environ.get("DTASK_BENCH_ARQ_MAX_JOBS", "10"))

        run_worker(WorkerSettings)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
