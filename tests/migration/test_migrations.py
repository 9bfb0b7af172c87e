"""Alembic owns the schema: migrations build exactly the models, and the gate fails closed."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from migrations.metadata import target_metadata
from tasks_core.db import SchemaNotCurrent, alembic_config, check_schema, head_revision, make_engine
from tasks_core.devkit.embedded import create_database, drop_database


@pytest.fixture
def empty_db() -> Iterator[str]:
    admin = os.environ["DTASK_TEST_ADMIN_URL"]
    name = f"dtask_mig_{uuid.uuid4().hex[:10]}"
    url = create_database(admin, name)
    yield url
    drop_database(admin, name)


def _diff(url: str) -> list[object]:
    async def go() -> list[object]:
        engine = make_engine(url, pool_size=1)
        try:
            async with engine.connect() as conn:
                return await conn.run_sync(
                    lambda sync: compare_metadata(MigrationContext.configure(sync), target_metadata)
                )
        finally:
            await engine.dispose()

    return asyncio.run(go())


def test_migrations_build_exactly_the_models(empty_db: str) -> None:
    command.upgrade(alembic_config(empty_db), "head")
    assert _diff(empty_db) == []


def test_downgrade_and_upgrade_again(empty_db: str) -> None:
    cfg = alembic_config(empty_db)
    command.upgrade(cfg, "head")
    command.downgrade(cfg, "base")
    command.upgrade(cfg, "head")


def test_schema_gate_fails_closed_until_migrated(empty_db: str) -> None:
    async def check() -> str:
        engine = make_engine(empty_db, pool_size=1)
        try:
            return await check_schema(engine)
        finally:
            await engine.dispose()

    with pytest.raises(SchemaNotCurrent, match="dtask migrate"):
        asyncio.run(check())
    command.upgrade(alembic_config(empty_db), "head")
    assert asyncio.run(check()) == head_revision()


def test_schema_gate_reports_an_unreachable_database() -> None:
    async def check() -> None:
        engine = make_engine("postgresql+asyncpg://nobody@127.0.0.1:1/none", pool_size=1)
        try:
            await check_schema(engine)
        finally:
            await engine.dispose()

    with pytest.raises(SchemaNotCurrent, match="cannot reach"):
        asyncio.run(check())
