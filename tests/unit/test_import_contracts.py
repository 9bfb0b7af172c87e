"""The import structure holds ([tool.importlinter] in pyproject.toml): the runtime imports no
development tooling, domain or application; nothing below the composition root imports it; the
runtime's rooms are layered; no cycle inside the worker or the duties."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_import_contract_is_kept() -> None:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(lint_imports), "--no-cache", "--config", str(ROOT / "pyproject.toml")],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout
