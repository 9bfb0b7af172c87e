"""Engine creation and the schema-version gate."""

from __future__ import annotations

import os
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import event, text
from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from tasks_core.domain import load_domains

ROOT = Path(__file__).resolve().parent.parent
MIGRATIONS_DIR = ROOT / "migrations"


# `dtask` commands and Celery sub-commands: the first one on the command line names the process role.
_ROLES = frozenset(
    {
        "worker",
        "beat",
        "flower",
        "api",
        "dev",
        "migrate",
        "db-status",
        "submit",
        "show",
        "list",
        "cancel",
        "prune",
        "bench",
        "chaos",
    }
)


def application_name() -> str:
    """How this process's connections appear in ``pg_stat_activity``: ``dtask-<role>:<pid>``.

    Operators (and the fault campaign, which terminates worker backends) tell a worker's
    connections from the API's or a client's by it. Engines are created after fork in worker pool
    children, so the pid is the child that owns the connection.
    """
    role = next((arg for arg in sys.argv[1:] if arg in _ROLES), "client")
    return f"dtask-{role}:{os.getpid()}"[:63]  # PostgreSQL keeps 63 bytes


# SQLSTATEs worth trying again: the server restarting or shutting down, a dropped connection,
# serialization failures and deadlocks (the transaction was rolled back and may simply be re-run),
# and a statement cancelled by a timeout.
TRANSIENT_SQLSTATES = frozenset(
    {"40001", "40P01", "57P01", "57P02", "57P03", "57014", "08000", "08001", "08003", "08004", "08006"}
)


def is_transient(exc: BaseException) -> bool:
    """Whether a database call failed for a reason that may pass (restart, blink, timeout), as
    opposed to a statement that is wrong and would fail again."""
    # PoolTimeout: every pooled connection stayed busy past the wait; a burst that passes.
    if isinstance(exc, OSError | TimeoutError | ConnectionError | PoolTimeout):
        return True
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:
            return True
        orig = exc.orig
        cause = getattr(orig, "__cause__", None)
        if isinstance(orig, OSError | TimeoutError) or isinstance(cause, OSError | TimeoutError):
            return True
        states = {getattr(orig, "sqlstate", None), getattr(cause, "sqlstate", None)}
        if states & TRANSIENT_SQLSTATES:
            return True
        # Connection-level failures (closed connection, cannot connect) surface as these.
        return isinstance(exc, OperationalError | InterfaceError) and not states - {None}
    try:
        import asyncpg
    except ImportError:  # pragma: no cover - asyncpg is a dependency
        return False
    # InternalClientError: the protocol got out of step with the server, as when a terminated
    # backend's notice arrives while the connection is idle; that connection is done, a fresh one works.
    return isinstance(
        exc, asyncpg.PostgresConnectionError | asyncpg.InterfaceError | asyncpg.InternalClientError
    ) or (getattr(exc, "sqlstate", None) in TRANSIENT_SQLSTATES)


async def db_now(engine: AsyncEngine) -> datetime:
    """PostgreSQL's clock: every stored timestamp comes from it, so ages and durations are read
    against it too, never against this host's clock."""
    async with engine.connect() as conn:
        now: datetime = (await conn.execute(text("SELECT clock_timestamp()"))).scalar_one()
    return now


def make_engine(
    url: str,
    *,
    pool_size: int = 5,
    idle_in_transaction_seconds: float | None = None,
    statement_seconds: float | None = None,
    connect_seconds: float = 5.0,
    max_overflow: int = 5,
    pool_wait_seconds: float | None = None,
    plan_cache_mode: str | None = None,
) -> AsyncEngine:
    """An asyncpg engine whose every call has a deadline (and, given, its sessions' plan_cache_mode).

    ``statement_seconds`` bounds each statement on the client side (a paused or partitioned server
    never answers, so a server-side timeout would not fire); ``connect_seconds`` bounds a new
    connection and, unless ``pool_wait_seconds`` is given, the wait for a pooled one.
    ``idle_in_transaction_seconds`` lets PostgreSQL end a
    session that sits inside a transaction that long: a paused or partitioned process must not keep
    holding a per-type claim lock or a task row (which would stall claims, or the reconciler,
    cluster-wide)."""
    # A connection whose server went away (a restart, a terminated backend) is replaced at checkout
    # without a round trip: asyncpg has already seen the socket close (_drop_closed). SQLAlchemy's
    # pool_pre_ping would also catch a silently dead peer, but on asyncpg it costs three round trips
    # per checkout (BEGIN, a query, ROLLBACK): 12% of the api's CPU per POST /tasks. A silently dead
    # peer fails its statement instead, which every caller retries or answers with a 503.
    connect_args: dict[str, object] = {}
    if "+asyncpg" in url.split("://", 1)[0]:
        server = {"application_name": application_name()}
        if idle_in_transaction_seconds:
            server["idle_in_transaction_session_timeout"] = str(
                max(1, int(idle_in_transaction_seconds * 1000))
            )
        if plan_cache_mode:
            server["plan_cache_mode"] = plan_cache_mode
        connect_args["server_settings"] = server
        connect_args["timeout"] = connect_seconds
        if statement_seconds:
            connect_args["command_timeout"] = statement_seconds
    engine = create_async_engine(
        url,
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_timeout=pool_wait_seconds or connect_seconds,
        connect_args=connect_args,
    )
    event.listen(engine.sync_engine, "checkout", _drop_closed)
    return engine


def _drop_closed(dbapi_connection: Any, record: Any, proxy: Any) -> None:
    """Refuse a pooled connection whose socket the server closed; the pool then connects afresh."""
    driver = getattr(dbapi_connection, "driver_connection", None)
    is_closed = getattr(driver, "is_closed", None)
    if is_closed is not None and is_closed():
        raise DisconnectionError("the server closed this pooled connection")


def alembic_config(url: str | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    # The runtime's versions, then each declared domain's own (domains/<name>/migrations): a domain
    # brings its tables with it. Only its declaration is imported, none of its code.
    locations = [MIGRATIONS_DIR / "versions", *(d.migrations for d in load_domains() if d.migrations)]
    cfg.set_main_option("path_separator", "os")
    cfg.set_main_option("version_locations", os.pathsep.join(str(p) for p in locations))
    if url:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


class SchemaNotCurrent(RuntimeError):
    pass


async def current_revision(engine: AsyncEngine) -> str | None:
    async with engine.connect() as conn:
        exists = (await conn.execute(text("SELECT to_regclass('alembic_version') IS NOT NULL"))).scalar()
        if not exists:
            return None
        return (await conn.execute(text("SELECT version_num FROM alembic_version"))).scalar()


async def check_schema(engine: AsyncEngine) -> str:
    """Fail closed unless the database is at exactly the revision this code was written for."""
    head = head_revision()
    try:
        current = await current_revision(engine)
    except (OperationalError, DBAPIError, OSError) as exc:
        raise SchemaNotCurrent(f"cannot reach the database: {exc}") from exc
    if current != head:
        raise SchemaNotCurrent(
            f"database schema is at {current or 'no version'}, this release needs {head}; "
            "run `dtask migrate` first"
        )
    return head or ""


def check_schema_blocking(url: str) -> None:
    """``check_schema`` for start-up code that has no event loop yet (CLI, Celery signals)."""
    import asyncio

    async def check() -> None:
        engine = make_engine(url, pool_size=1)
        try:
            await check_schema(engine)
        finally:
            await engine.dispose()

    asyncio.run(check())
