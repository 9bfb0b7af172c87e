"""A real api for tests that talk HTTP to it: uvicorn serving an app object in a thread, or
`dtask api` itself as a child process."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import httpx
import uvicorn

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def serve(app: Any) -> Iterator[str]:
    """Yields the base URL once uvicorn is serving ``app``; stops it on the way out."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def api_process(
    *,
    dtask: list[str | Path] | None = None,
    cwd: Path | None = None,
    environ: dict[str, str] | None = None,
    start_seconds: float = 30,
    log: IO[bytes] | None = None,
    **env: str,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`dtask api` on a free loopback port, with the test environment plus ``env`` (DTASK_*
    settings); yields its base URL and process once /healthz answers, and stops it afterwards.
    ``dtask`` is the command (default: this checkout's), ``environ`` the whole environment instead
    of the test's, ``log`` a file that keeps the api's output for the caller."""
    from tasks_core.devkit.embedded import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = dtask or [sys.executable, "-m", "tasks_core.ops.cli"]
    base = environ if environ is not None else {**os.environ, "PYTHONPATH": str(ROOT)}
    with contextlib.ExitStack() as stack:
        if log is None:  # its output, shown when it does not start
            log = stack.enter_context(tempfile.TemporaryFile())
        proc = subprocess.Popen(
            [*command, "api", "--port", str(port)],
            cwd=cwd,
            env={**base, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + start_seconds
            while True:
                try:
                    if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    output = log.read()[-4000:].decode(errors="replace")
                    raise AssertionError(f"dtask api did not start:\n{output}")
                time.sleep(0.1)
            yield url, proc
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for {pid}")
