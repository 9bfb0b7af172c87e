"""The README's settings table, generated from the settings classes so the two cannot drift.

Each row is a field of the runtime's ``Settings``, then of each domain's settings class (its
``Domain.settings``): its ``DTASK_*`` variable, its default, and its ``Field(description=…)`` or
else the comment written right above it in the class. Regenerate with ``scripts/settings-table``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any

from pydantic import AliasChoices
from pydantic_settings import BaseSettings

from tasks_core.domain import load_domains
from tasks_core.settings import Settings

START = (
    "<!-- settings table: generated from tasks_core/settings.py and each domain's settings"
    " by scripts/settings-table -->"
)
END = "<!-- end of settings table -->"
_FIELD = re.compile(r"^    (\w+)\s*:")
_COMMENT = re.compile(r"^    #\s?(.*)$")


def _comments(cls: type[BaseSettings]) -> dict[str, str]:
    """Field name -> the comment lines just above it, joined."""
    found: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        comment, field = _COMMENT.match(line), _FIELD.match(line)
        if comment:
            pending.append(comment.group(1).strip())
            continue
        if field:
            found[field.group(1)] = " ".join(pending)
        pending = []
    return found


def default_text(value: Any) -> str:
    if value is None or value == "":
        return "—"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return f"`{value}`" if isinstance(value, str) else str(value)


def settings_classes() -> list[type[BaseSettings]]:
    """The runtime's Settings, then each domain's settings class, in the domains' order."""
    found: list[type[BaseSettings]] = [Settings]
    for domain in load_domains():
        for path in domain.settings:
            module, _, attr = path.partition(":")
            found.append(getattr(importlib.import_module(module), attr))
    return found


def variable(cls: type[BaseSettings], name: str) -> str:
    """The environment variable a field is read from: its alias if it has one, else prefix + name."""
    alias = cls.model_fields[name].validation_alias
    if isinstance(alias, str):
        return alias.upper()
    if isinstance(alias, AliasChoices) and isinstance(alias.choices[0], str):
        return alias.choices[0].upper()
    return f"{cls.model_config.get('env_prefix', '')}{name}".upper()


def render() -> str:
    rows = ["| variable | default | what it does |", "|---|---|---|"]
    for cls in settings_classes():
        comments = _comments(cls)
        for name, field in cls.model_fields.items():
            why = (field.description or comments.get(name, "")).replace("|", "\\|")
            rows.append(f"| `{variable(cls, name)}` | {default_text(field.default)} | {why} |")
    return "\n".join(rows)


def table_in(text: str) -> str:
    """The generated table as it currently stands in ``text`` (between the markers)."""
    try:
        start = text.index(START) + len(START)
        return text[start : text.index(END, start)].strip()
    except ValueError:
        return ""


def rewrite(text: str) -> str:
    if START not in text or END not in text:
        raise SystemExit(f"README has no settings-table markers ({START} … {END})")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{render()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate the README's settings table.")
    parser.add_argument("readme", nargs="?", default="README.md", type=Path)
    parser.add_argument("--check", action="store_true", help="exit 1 if the table is out of date")
    args = parser.parse_args(argv)
    text = args.readme.read_text()
    new = rewrite(text)
    if args.check:
        if new != text:
            print(f"{args.readme}: the settings table is out of date; run scripts/settings-table")
            return 1
        return 0
    if new != text:
        args.readme.write_text(new)
        print(f"{args.readme}: settings table regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
