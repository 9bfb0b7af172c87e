"""Engine creation and the schema-version gate."""

from __future__ import annotations

from pathlib import Path

from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def make_engine(url: str, *, pool_size: int = 5) -> AsyncEngine:
    # pool_pre_ping: a worker whose backend was terminated reconnects instead of failing a write.
    return create_async_engine(url, pool_size=pool_size, max_overflow=5, pool_pre_ping=True)


def alembic_config(url: str | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
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
