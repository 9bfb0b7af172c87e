"""Flower behind basic auth, against a real worker on the test broker; refusal without auth."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_sync

from tasks_core.devkit.cluster import Cluster, ClusterProcess
from tasks_core.devkit.processes import free_port, port_is_free
from tasks_core.ops.flower import FlowerConfigError, flower_argv, parse_basic_auth
from tasks_core.settings import Settings

pytestmark = pytest.mark.system

AUTH = ("flower-admin", "s3cret pass")


def _flower_cmd(address: str, port: int, insecure_local: bool = False) -> list[str]:
    # The exact body `dtask flower` runs, so this works before and after the command is wired.
    code = ("from tasks_core.ops.flower import flower_command; "
            f"flower_command({address!r}, {port}, {insecure_local})")
    return [sys.executable, "-c", code]


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


@pytest.fixture
def flower_stack(tmp_path: Path, redis_client: redis_sync.Redis) -> Iterator[dict[str, Any]]:
    redis_client.flushdb()  # no stale task ids for this worker to pick up
    port = free_port()
    worker_name = f"flowertest-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, DTASK_FLOWER_BASIC_AUTH=f"{AUTH[0]}:{AUTH[1]}")
    # cwd=tmp_path: no stray .env or flowerconfig.py from the checkout changes what starts. Each
    # process leads its own session: the teardown's killpg reaches the prefork children too.
    cluster = Cluster(tmp_path, ClusterProcess)
    try:
        cluster.start_worker("worker", env, node=f"{worker_name}@{os.uname().nodename}", concurrency=2)
        cluster.spawn("flower", _flower_cmd("127.0.0.1", port), env)
        procs = [proc.popen for proc in cluster.procs]
        logs = {proc.name: proc.log for proc in cluster.procs}
        yield {"base": f"http://127.0.0.1:{port}", "worker": worker_name, "procs": procs, "logs": logs}
    finally:
        cluster.stop_all()


def _wait_for(what: str, check: Any, stack: dict[str, Any], timeout: float = 25.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in stack["procs"]:
            if proc.poll() is not None:
                pytest.fail(f"a process exited ({proc.returncode}) while waiting for {what}\n"
                            + "\n".join(f"--- {n}\n{_tail(p)}" for n, p in stack["logs"].items()))
        try:
            result = check()
        except httpx.TransportError:
            result = None
        if result:
            return result
        time.sleep(0.3)
    pytest.fail(f"timed out waiting for {what}\n"
                + "\n".join(f"--- {n}\n{_tail(p)}" for n, p in stack["logs"].items()))


def test_flower_requires_basic_auth_and_lists_the_worker(flower_stack: dict[str, Any]) -> None:
    stack = flower_stack
    base = stack["base"]
    with httpx.Client(base_url=base, timeout=5) as client:
        # /healthcheck is open by Flower's design; it tells us the server is up.
        _wait_for("flower to answer", lambda: client.get("/healthcheck").status_code == 200, stack)

        for path in ("/api/workers", "/", "/workers"):
            assert client.get(path).status_code == 401, path
        assert client.get("/api/workers", auth=(AUTH[0], "wrong")).status_code == 401

        def workers() -> dict[str, Any] | None:
            # refresh=1 makes Flower run `inspect` now instead of serving its cached view.
            resp = client.get("/api/workers", params={"refresh": 1}, auth=AUTH)
            assert resp.status_code == 200, resp.text
            found = {k: v for k, v in resp.json().items() if k.startswith(f"{stack['worker']}@")}
            return found or None

        found = _wait_for("the worker to appear in /api/workers", workers, stack)
    (info,) = found.values()
    assert {q["name"] for q in info["active_queues"]} == {"durable", "duties"}
    assert "dtask.run" in info["registered"]


def test_refuses_to_start_unauthenticated_on_a_public_address(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DTASK_FLOWER_BASIC_AUTH"}
    port = free_port()
    for insecure_local in (False, True):  # the dev opt-in never covers a non-loopback address
        done = subprocess.run(_flower_cmd("0.0.0.0", port, insecure_local), env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 2, done.stderr
        assert "refusing to start Flower without authentication" in done.stderr
        assert "DTASK_FLOWER_BASIC_AUTH" in done.stderr
    # Nothing was left listening.
    assert port_is_free(port)


def test_malformed_basic_auth_is_a_clear_error_without_echoing_it(tmp_path: Path) -> None:
    env = dict(os.environ, DTASK_FLOWER_BASIC_AUTH="just-a-password-no-user")
    done = subprocess.run(_flower_cmd("127.0.0.1", free_port(), True), env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "must be 'user:password'" in done.stderr
    assert "just-a-password-no-user" not in done.stderr


@pytest.mark.parametrize("value", ["nocolon", ":pw", "user:", "us er:pw", "a:b,", "a:b,c", ""])
def test_basic_auth_format(value: str) -> None:
    with pytest.raises(FlowerConfigError):
        parse_basic_auth(value)


def test_argv_passes_auth_address_and_port() -> None:
    settings = Settings(broker_url="redis://127.0.0.1:6379/0", flower_basic_auth="ops:p:w d, dev:x")
    assert flower_argv(settings, "0.0.0.0", 5555) == [
        "flower", "--address=0.0.0.0", "--port=5555", "--basic-auth=ops:p:w d,dev:x"]


@pytest.mark.parametrize(
    ("address", "allowed"),
    [("127.0.0.1", True), ("localhost", True), ("::1", True), ("0.0.0.0", False), ("", False)],
)
def test_unauthenticated_only_with_opt_in_on_loopback(address: str, allowed: bool) -> None:
    settings = Settings(broker_url="redis://127.0.0.1:6379/0", flower_basic_auth=None)
    with pytest.raises(FlowerConfigError):
        flower_argv(settings, address, 5555)
    if allowed:
        argv = flower_argv(settings, address, 5555, allow_unauthenticated_local=True)
        assert not any(a.startswith("--basic-auth") for a in argv)
    else:
        with pytest.raises(FlowerConfigError):
            flower_argv(settings, address, 5555, allow_unauthenticated_local=True)
