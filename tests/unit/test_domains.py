"""The domains' declarations: every part they name exists, and the imports go one way only (a
domain may use `app`'s helpers; `app` and `tasks_core` reach a domain only through its Domain)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from tasks_core.domain import DOMAINS, Domain, load_domains
from tasks_core.registry import DOMAIN_CLIS, DOMAIN_SPEC_MODULES, import_path

ROOT = Path(__file__).resolve().parents[2]


def _imported(package: str) -> dict[str, set[str]]:
    """Module file -> the top-level packages it imports by name."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


@pytest.mark.parametrize("package", ["app", "tasks_core"])
def test_app_and_the_runtime_never_import_a_domain_by_name(package: str) -> None:
    offenders = sorted(path for path, names in _imported(package).items() if "domains" in names)
    assert not offenders, offenders


def test_every_domain_directory_is_declared_and_every_declaration_resolves() -> None:
    domains = load_domains()
    assert len(domains) == len(DOMAINS)
    on_disk = {p.parent.name for p in (ROOT / "domains").glob("*/__init__.py")}
    assert {d.name for d in domains} == on_disk
    for domain in domains:
        assert isinstance(domain, Domain) and domain.root == ROOT / "domains" / domain.name
        for module in (*domain.tasks, *([domain.metadata] if domain.metadata else [])):
            importlib.import_module(module)
        paths = [domain.api, domain.ui, *domain.settings, domain.path_limits, domain.cli and domain.cli[1]]
        for path in [*paths, *domain.api_errors, *domain.api_errors.values(), *domain.readiness.values()]:
            if path:
                assert import_path(path) is not None, path


def test_the_registry_and_the_command_line_are_derived_from_the_declarations() -> None:
    assert tuple(m for d in load_domains() for m in d.tasks) == DOMAIN_SPEC_MODULES
    assert ("kb", "domains.knowledge.cli:cli") in DOMAIN_CLIS
    with_tables = [d.name for d in load_domains() if d.migrations is not None]
    assert with_tables == ["knowledge", "evaluation", "graph"]  # diagnostics' tables are the runtime's
