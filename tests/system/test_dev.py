"""`dtask dev` on a fresh directory: embedded PostgreSQL and Redis, the whole stack, Ctrl-C stops it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.system


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_line(log: Path, pattern: str, proc: subprocess.Popen[bytes], timeout: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text(errors="replace"))
        if found:
            return found
        assert proc.poll() is None, f"dtask dev exited early:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"{pattern!r} not printed in {timeout} s:\n{log.read_text()[-3000:]}")


def test_dev_runs_the_whole_stack_on_embedded_services_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTASK_")}
    api_port, flower_port = _free_port(), _free_port()
    log = tmp_path / "dev.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tasks_core.cli",
                "dev",
                "--data-dir",
                str(tmp_path / "data"),
                "--api-port",
                str(api_port),
                "--flower-port",
                str(flower_port),
            ],
            env=env,
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        key = _wait_line(log, r"API key    : (\S+)", proc, 90).group(1)
        headers = {"Authorization": f"Bearer {key}"}
        base = f"http://127.0.0.1:{api_port}"
        deadline = time.monotonic() + 60
        task = None
        while time.monotonic() < deadline and task is None:
            try:
                r = httpx.post(
                    f"{base}/tasks",
                    headers=headers,
                    json={"task_type": "diagnostics.sleep", "payload": {"seconds": 1, "steps": 2}},
                )
                task = r.json() if r.status_code == 202 else None
            except httpx.TransportError:
                time.sleep(0.5)  # the API is still starting
        assert task is not None, log.read_text()[-3000:]
        status = None
        while time.monotonic() < deadline and status != "success":
            status = httpx.get(f"{base}/tasks/{task['id']}", headers=headers).json()["status"]
            time.sleep(0.3)
        assert status == "success", log.read_text()[-3000:]
        # Readiness needs beat -> broker -> worker -> PostgreSQL -> Redis: the whole chain.
        while time.monotonic() < deadline and httpx.get(f"{base}/readyz").status_code != 200:
            time.sleep(0.5)
        assert httpx.get(f"{base}/readyz").status_code == 200
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        try:
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert code == 0, log.read_text()[-3000:]
    # Everything it started is gone: nothing listens on its ports any more.
    for port in (api_port, flower_port):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0
