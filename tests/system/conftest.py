"""Real worker and beat processes for the system tests.

Each test gets a ``cluster``: it starts ``celery -A tasks_core.celery_app worker|beat`` (or the
``dtask`` CLI) as subprocesses against the session's test database and Redis DB index (exported
by the root conftest), each in its own session/process group so a test can SIGKILL a worker with
all its pool children. Logs go to files under ``tmp_path`` and are printed when a test fails.
Teardown always kills whatever is left, whole process groups included.

Readiness is polled, never slept for: a worker is ready when it answers a remote-control ping
under its node name; beat is ready when a reconcile it scheduled has written the readiness key.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis as redis_sync

from tasks_core.devkit.processes import GroupProcess, kill_group, spawn
from tests.tools import require_rabbitmq

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")

# The protocol timings every system test runs with (overridable per process).
LEASE_SECONDS = 3.0
RECONCILE_SECONDS = 1.0
PUBLISH_SECONDS = 2.0
SHUTDOWN_GRACE_SECONDS = 1.0
BASE_ENV = {
    "DTASK_LEASE_SECONDS": str(LEASE_SECONDS),
    "DTASK_RECONCILE_SECONDS": str(RECONCILE_SECONDS),
    "DTASK_PUBLISH_SECONDS": str(PUBLISH_SECONDS),
    "DTASK_SHUTDOWN_GRACE_SECONDS": str(SHUTDOWN_GRACE_SECONDS),
}
READINESS_KEY = "dtask:readiness"
STARTUP_TIMEOUT = 45.0
LOG_TAIL_LINES = 250


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    # Remember each phase's report so the cluster fixture can tell whether the test failed.
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


async def wait_for(
    probe: Callable[[], Awaitable[T | None]], *, within: float, interval: float = 0.1, what: str = "condition"
) -> T:
    """Poll ``probe`` until it returns something other than None (or False); fail after ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        value = await probe()
        if value is not None and value is not False:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {within:g} s waiting for {what}")
        await asyncio.sleep(interval)


@dataclass
class Proc(GroupProcess):
    """A started process (tasks_core.devkit.processes does the signalling); a worker knows its node name."""

    node: str | None = None

    def killpg(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group: the main process and every pool child."""
        self.signal_group(sig)


@dataclass
class Broker:
    """The transport the processes of a test use: the session's Redis DB (default) or a RabbitMQ
    vhost of this test run's own. Readiness and metrics stay on the session's Redis either way."""

    kind: str
    url: str

    @property
    def env(self) -> dict[str, str]:
        return {"DTASK_BROKER_URL": self.url}


class Cluster:
    def __init__(self, tmp_path: Path, redis_client: redis_sync.Redis, broker: Broker | None = None) -> None:
        self.dir = tmp_path
        self.redis = redis_client
        self.broker = broker
        self.procs: list[Proc] = []
        self._app: Any = None

    # ------------------------------------------------------------------ environment

    def env(self, **overrides: str) -> dict[str, str]:
        # Only the test services from the root conftest: no DTASK_* setting from the developer's
        # shell (capacity, concurrency, extra task modules...) changes what the processes do.
        keep = {"DTASK_DATABASE_URL", "DTASK_BROKER_URL", "DTASK_REDIS_URL"}
        env = {k: v for k, v in os.environ.items() if not k.startswith("DTASK_") or k in keep}
        env.update(BASE_ENV)
        if self.broker is not None:
            env.update(self.broker.env)
        env.update(overrides)
        # The subprocesses import the code under test from this checkout, whatever is installed.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _spawn(self, name: str, argv: list[str], env: dict[str, str], node: str | None = None) -> Proc:
        log = self.dir / f"{name}.log"
        # Its own process group: killpg reaches the pool children too, and a signal meant for the
        # test runner never reaches the workers. cwd is outside the checkout, so no developer .env
        # is read; PYTHONPATH finds the code.
        popen = spawn(argv, env=env, log=log, cwd=self.dir)
        proc = Proc(name, popen, log, node)
        self.procs.append(proc)
        return proc

    # ------------------------------------------------------------------ processes

    def start_worker(
        self,
        name: str = "worker",
        *,
        concurrency: int = 3,
        cli: bool = False,
        pool: str = "prefork",
        **env: str,
    ) -> Proc:
        """A worker; ``pool`` is prefork (a process per task) or threads (the dense mode)."""
        node = f"{name}-{uuid.uuid4().hex[:6]}@%h"
        if cli:
            argv = [sys.executable, "-m", "tasks_core.ops.cli", "worker", "-c", str(concurrency), "-n", node]
            argv += ["--pool", pool]
        else:
            argv = [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "tasks_core.celery_app",
                "worker",
                "-Q",
                "durable,duties",
                "-c",
                str(concurrency),
                "-P",
                pool,
                "-l",
                "INFO",
                "-n",
                node,
                # Neighbour discovery only slows start-up; nothing here depends on it.
                "--without-mingle",
                "--without-gossip",
            ]
        expanded = node.replace("%h", os.uname().nodename)
        return self._spawn(name, argv, self.env(**env), node=expanded)

    def start_beat(self, name: str = "beat", *, cli: bool = False, **env: str) -> Proc:
        schedule = str(self.dir / f"{name}-schedule")
        if cli:
            argv = [sys.executable, "-m", "tasks_core.ops.cli", "beat", "--schedule", schedule]
        else:
            argv = [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "tasks_core.celery_app",
                "beat",
                "-s",
                schedule,
                "-l",
                "INFO",
            ]
        return self._spawn(name, argv, self.env(**env))

    def run_cli(self, *args: str, timeout: float = 60.0, **env: str) -> subprocess.CompletedProcess[str]:
        """Run one `dtask` command to completion (the same entry point as the console script)."""
        return subprocess.run(
            [sys.executable, "-m", "tasks_core.ops.cli", *args],
            env=self.env(**env),
            cwd=self.dir,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    # ------------------------------------------------------------------ readiness

    def _control_app(self) -> Any:
        if self._app is None:
            if self.broker is not None and self.broker.kind != "redis":
                self._app = _app_on(self.broker.url)
            else:
                from tasks_core.celery_app import app

                self._app = app
        return self._app

    async def wait_worker_ready(
        self, proc: Proc, within: float = STARTUP_TIMEOUT, *, broker: str | None = None
    ) -> None:
        """Ready = the worker's consumer answers a ping addressed to its own node name (through
        ``broker`` when the worker uses another than the session's)."""
        app = self._control_app() if broker is None else _app_on(broker)

        async def answered() -> bool:
            if not proc.alive():
                raise AssertionError(f"{proc.name} exited with {proc.popen.returncode} before it was ready")
            replies = await asyncio.to_thread(app.control.ping, destination=[proc.node], timeout=0.5)
            return any(proc.node in reply for reply in replies or [])

        await wait_for(answered, within=within, interval=0.2, what=f"{proc.name} to answer a ping")

    async def wait_readiness_fact(self, within: float = STARTUP_TIMEOUT) -> None:
        """Beat scheduled a reconcile and a worker ran it: the chain that recovers tasks is up."""
        self.redis.delete(READINESS_KEY)

        async def written() -> bool:
            for proc in self.procs:
                if not proc.alive() and proc.popen.returncode not in (None, 0, -signal.SIGKILL):
                    raise AssertionError(f"{proc.name} exited with {proc.popen.returncode}")
            return bool(self.redis.exists(READINESS_KEY))

        await wait_for(written, within=within, interval=0.2, what="the readiness key")

    # ------------------------------------------------------------------ teardown

    def stop_all(self) -> None:
        for proc in self.procs:
            proc.killpg(signal.SIGKILL)
        for proc in self.procs:
            kill_group(proc.popen)

    def dump_logs(self) -> str:
        parts = []
        for proc in self.procs:
            lines = proc.log_text().splitlines()
            parts.append(
                f"===== {proc.name} (pid {proc.pid}, node {proc.node}, exit {proc.popen.returncode}), "
                f"last {min(len(lines), LOG_TAIL_LINES)} of {len(lines)} lines =====\n"
                + "\n".join(lines[-LOG_TAIL_LINES:])
            )
        return "\n".join(parts)


def _app_on(broker: str) -> Any:
    """A Celery app on ``broker`` declaring our queues as the workers do (quorum on RabbitMQ)."""
    from celery import Celery

    import celeryconfig

    app = Celery("control", set_as_current=False)
    app.config_from_object("celeryconfig")
    app.conf.update(celeryconfig.broker_settings(broker), beat_schedule={})
    return app


@pytest.fixture(scope="session")
def rabbitmq_url() -> Iterator[str]:
    """A vhost of this test run's own on the machine's RabbitMQ (created and deleted through
    rabbitmqctl), so runs never share queues."""
    from tasks_core.devkit.rabbitmq import PrivateVhost

    require_rabbitmq()
    vhost = PrivateVhost(prefix="dtask_test")
    try:
        yield vhost.create()
    finally:
        vhost.delete()


@pytest.fixture(params=["redis"])
def broker(request: pytest.FixtureRequest, broker_url: str) -> Broker:
    """The session's Redis unless a test parametrizes it (indirect) with "rabbitmq"."""
    if request.param == "rabbitmq":
        return Broker("rabbitmq", request.getfixturevalue("rabbitmq_url"))
    return Broker("redis", broker_url)


@pytest.fixture
async def services(clean_db: None, broker: Broker) -> Any:
    """The test's own submitter and reader, publishing on the test's broker."""
    from tasks_core.services import build_services
    from tasks_core.transport import CeleryTransport
    from tests.conftest import make_settings

    transport = CeleryTransport(_app_on(broker.url)) if broker.kind != "redis" else None
    svc = build_services(make_settings(broker_url=broker.url), transport=transport, pool_size=10)
    yield svc
    await svc.close()


@pytest.fixture
def cluster(
    request: pytest.FixtureRequest,
    clean_db: None,
    tmp_path: Path,
    redis_client: redis_sync.Redis,
    broker: Broker,
) -> Iterator[Cluster]:
    c = Cluster(tmp_path, redis_client, broker)
    try:
        yield c
    finally:
        c.stop_all()
        reports = [getattr(request.node, f"rep_{phase}", None) for phase in ("setup", "call")]
        failed = any(report is not None and report.failed for report in reports)
        if failed:
            print(c.dump_logs())
