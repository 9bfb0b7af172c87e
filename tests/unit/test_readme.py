"""The README stays true: its settings table is the one generated from the Settings class, and it
documents what a newcomer needs from the command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks_core.ops import settings_doc
from tasks_core.ops.cli_errors import Exit
from tasks_core.settings import Settings

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_settings_table_is_generated_from_the_settings_class() -> None:
    assert settings_doc.table_in(README.read_text()) == settings_doc.render(), (
        "README.md's settings table differs from tasks_core/settings.py: run `scripts/settings-table`"
    )


def test_every_setting_is_in_the_table_with_its_default() -> None:
    table = settings_doc.render()
    for name, field in Settings.model_fields.items():
        assert f"| `DTASK_{name.upper()}` | {settings_doc.default_text(field.default)} |" in table


@pytest.mark.parametrize(
    "needle",
    [
        "./scripts/bootstrap && .venv/bin/dtask dev",
        "./scripts/bootstrap && .venv/bin/pytest",
        "--api-port",
        "--flower-port",
        "--data-dir",
        "--verbose",
        "--insecure-local",
        "list --status",
        "--type",
        "source .dtask/env",
        "SIGTERM",
    ],
)
def test_the_readme_mentions(needle: str) -> None:
    assert needle in README.read_text()


def test_the_readme_lists_every_exit_code() -> None:
    text = README.read_text()
    for code in Exit:
        assert f"| {int(code)} |" in text, code
