"""The Promela model of the protocol (docs/protocol/durable.pml), exhaustively checked by spin for
every bounded configuration, and every mutant of it caught (scripts/check-protocol)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.tools import require

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check-protocol"


def _need_spin() -> None:
    require(
        shutil.which("spin") is not None and shutil.which("gcc") is not None,
        "spin and gcc",
        "./scripts/bootstrap installs them as root: apt-get install spin gcc",
    )


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, check=False
    )


def test_every_configuration_verifies() -> None:
    _need_spin()
    done = _check()
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [ln for ln in done.stdout.splitlines() if ln.startswith(("safety-", "live-"))]
    assert len(rows) == 6 and all(" ok " in ln for ln in rows), done.stdout


def test_every_mutant_is_caught() -> None:
    _need_spin()
    done = _check("--mutants")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SURVIVED" not in done.stdout
    assert done.stdout.count("caught") == 9, done.stdout
