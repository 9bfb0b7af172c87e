"""`dtask dev`: the whole system in one command.

Uses DTASK_DATABASE_URL / DTASK_BROKER_URL when set; otherwise starts embedded PostgreSQL and
Redis from wheels under a local data directory. Then migrates and runs worker, beat and the API as
child processes, prints what runs where, and stops everything cleanly on Ctrl-C.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from tasks_core.settings import Settings

DEV_DATABASE = "dtask"


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "tasks_core.cli", *args]


def run_dev(
    settings: Settings, *, data_dir: str | None = None, api_port: int = 8000, flower_port: int = 5555
) -> int:
    from tasks_core.embedded import EmbeddedPostgres, EmbeddedRedis, create_database

    root = Path(data_dir or settings.dev_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    stops: list[tuple[str, object]] = []
    children: list[tuple[str, subprocess.Popen[bytes]]] = []
    env = dict(os.environ)
    try:
        db_url = settings.database_url
        if not db_url:
            pg = EmbeddedPostgres(root / "postgres")
            admin = pg.start()
            stops.append(("postgres", pg))
            db_url = _ensure_database(admin, create_database)
        broker = settings.broker_url
        if not broker:
            redis = EmbeddedRedis(root / "redis")
            broker = redis.start()
            stops.append(("redis", redis))
        env.update(
            DTASK_DATABASE_URL=db_url, DTASK_BROKER_URL=broker, DTASK_REDIS_URL=settings.redis_url or broker
        )
        api_key = None
        if not settings.api_keys:
            api_key = secrets.token_urlsafe(18)  # a key for this session only, printed below
            env["DTASK_API_KEYS"] = f"dev:{api_key}:admin"

        subprocess.run(_cli("migrate"), env=env, check=True)
        children.append(("worker", subprocess.Popen(_cli("worker"), env=env)))
        children.append(
            ("beat", subprocess.Popen(_cli("beat", "--schedule", str(root / "celerybeat-schedule")), env=env))
        )
        children.append(
            ("api", subprocess.Popen(_cli("api", "--host", "127.0.0.1", "--port", str(api_port)), env=env))
        )
        flower = _cli("flower", "--address", "127.0.0.1", "--port", str(flower_port))
        if not settings.flower_basic_auth:
            flower.append("--insecure-local")  # loopback only, dev only
        children.append(("flower", subprocess.Popen(flower, env=env)))
        _banner(db_url, broker, root, api_port, flower_port, api_key)
        return _supervise(children)
    except KeyboardInterrupt:
        return 0
    except subprocess.CalledProcessError as exc:
        print(f"dtask dev: {exc}", file=sys.stderr)
        return 1
    finally:
        _stop_children(children)
        for _name, server in reversed(stops):
            server.stop()  # type: ignore[attr-defined]


def _ensure_database(admin_url: str, create: object) -> str:
    """The dev database on the embedded server, created once and reused across runs."""
    import asyncio

    import asyncpg

    async def exists() -> bool:
        dsn = admin_url.replace("postgresql+asyncpg://", "postgresql://")
        conn = await asyncpg.connect(dsn)
        try:
            return bool(await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", DEV_DATABASE))
        finally:
            await conn.close()

    if not asyncio.run(exists()):
        return str(create(admin_url, DEV_DATABASE))  # type: ignore[operator]
    return admin_url.rsplit("/", 1)[0] + f"/{DEV_DATABASE}"


def _banner(
    db_url: str, broker: str, root: Path, api_port: int, flower_port: int, api_key: str | None
) -> None:
    lines = [
        "durable-tasks dev stack is running (Ctrl-C stops everything)",
        f"  PostgreSQL : {db_url}",
        f"  Redis      : {broker}",
        "  worker     : dtask worker (queues durable, duties)",
        "  beat       : dtask beat (publisher, reconciler)",
        f"  API        : http://127.0.0.1:{api_port}  (OpenAPI at /docs)",
        f"  Flower     : http://127.0.0.1:{flower_port}",
        f"  data dir   : {root}",
    ]
    if api_key:
        lines.append(f"  API key    : {api_key}  (admin, this session only; set DTASK_API_KEYS to choose)")
    lines += [
        f"  CLI env    : export DTASK_DATABASE_URL={db_url} DTASK_BROKER_URL={broker}",
        '  try        : dtask submit diagnostics.sleep --payload \'{"seconds": 5, "steps": 5}\' --wait',
    ]
    print("\n".join(lines), flush=True)


def _supervise(children: list[tuple[str, subprocess.Popen[bytes]]]) -> int:
    while True:
        for name, proc in children:
            code = proc.poll()
            if code is not None:
                print(f"dtask dev: {name} exited with {code}; stopping the rest", file=sys.stderr)
                return 1
        time.sleep(0.5)


def _stop_children(children: list[tuple[str, subprocess.Popen[bytes]]]) -> None:
    for _name, proc in children:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    for _name, proc in children:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
