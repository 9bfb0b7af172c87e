"""Settings: URL normalisation, and placeholders refused where a secret belongs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks_core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


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


# ------------------------------------------------------------------ placeholders are not secrets

@pytest.mark.parametrize(("field", "value"), [
    ("api_keys", "ops:replace-with-a-long-random-secret:admin"),
    ("api_keys", "alice:alice-s3cret-0123456789,bob:CHANGE_ME_CHANGE_ME_1"),
    ("flower_basic_auth", "admin:replace-with-a-long-random-password"),
    ("flower_basic_auth", "ops:a-real-one-7f3c9,admin:password"),
    ("metrics_token", "changeme"),
    ("minio_secret_key", "change-me-too"),
    ("minio_secret_key", "Secret"),
])  # fmt: skip
def test_placeholder_secrets_are_refused_naming_the_setting(field: str, value: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as raised:
        Settings(_env_file=None, **{field: value})  # type: ignore[call-arg]
    assert "placeholder" in str(raised.value) and field in str(raised.value)
    assert value not in str(raised.value)  # a secret field's input is never echoed


def test_real_secrets_and_words_that_merely_contain_a_placeholder_are_accepted() -> None:
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None,
        api_keys="alice:alice-secret-0123456,ops:password-manager-made-7Hq2:admin",
        flower_basic_auth="admin:kJ8-secretive-horse",
        metrics_token="scrape-token-0123456789",
        minio_secret_key="",  # unset (compose passes empty values through)
    )
    assert settings.api_keys.startswith("alice:")


PROCESSES = {
    "api": ["api", "--port", "1"],
    "worker": ["worker"],
    "flower": ["flower", "--insecure-local"],
}


# Every process refuses through the same settings; each setting is covered once above.
@pytest.mark.parametrize(("command", "var", "value"), [
    ("api", "DTASK_API_KEYS", "ops:replace-with-a-long-random-secret:admin"),
    ("api", "DTASK_METRICS_TOKEN", "change-me"),
    ("worker", "DTASK_API_KEYS", "ops:replace-with-a-long-random-secret:admin"),
    ("worker", "DTASK_MINIO_SECRET_KEY", "change-me-too"),
    ("flower", "DTASK_FLOWER_BASIC_AUTH", "admin:replace-with-a-long-random-password"),
])  # fmt: skip
def test_api_worker_and_flower_refuse_to_start_with_a_placeholder(
    command: str, var: str, value: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTASK_")}
    env |= {"PYTHONPATH": str(ROOT), "DTASK_BROKER_URL": "redis://127.0.0.1:1/0", var: value}
    done = subprocess.run(
        [sys.executable, "-m", "tasks_core.ops.cli", *PROCESSES[command]],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and var in lines[0] and "placeholder" in lines[0], done.stderr
    assert value not in done.stderr
