"""Settings: URL normalisation."""

from __future__ import annotations

import pytest

from tasks_core.settings import Settings


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:p@db:5432/tasks",
        "postgres://u:p@db:5432/tasks",
        "postgresql+asyncpg://u:p@db:5432/tasks",
    ],
)
def test_a_postgresql_url_means_asyncpg(url: str) -> None:
    settings = Settings(_env_file=None, database_url=url)  # type: ignore[call-arg]
    assert settings.database_url == "postgresql+asyncpg://u:p@db:5432/tasks"


def test_other_drivers_are_left_alone() -> None:
    settings = Settings(_env_file=None, database_url="postgresql+psycopg://u@db/tasks")  # type: ignore[call-arg]
    assert settings.database_url == "postgresql+psycopg://u@db/tasks"
