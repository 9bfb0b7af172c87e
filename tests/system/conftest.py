"""Real worker and beat processes for the system tests.

Each test gets a ``cluster``: a thin fixture over ``tasks_core.devkit.cluster.Cluster``, which
starts ``celery -A tasks_core.celery_app worker|beat`` (or the ``dtask`` CLI) as subprocesses
against the session's test database and Redis DB index (exported by the root conftest), each in
its own session/process group so a test can SIGKILL a worker with all its pool children. Logs go
to files under ``tmp_path`` and are printed when a test fails. Teardown always kills whatever is
left, whole process groups included.

Readiness is polled, never slept for: a worker is ready when it answers a remote-control ping
under its node name; beat is ready when a reconcile it scheduled has written the readiness key.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis as redis_sync

from tasks_core.devkit import cluster as harness
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
    return await harness.poll(probe, within=within, interval=interval, what=what)


@dataclass
class Proc(harness.ClusterProcess):
    """A started process (tasks_core.devkit.processes does the signalling); a worker knows its node name."""

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
        self.harness = harness.Cluster(tmp_path, Proc)
        self.procs = self.harness.procs
        self._app: Any = None

    # ------------------------------------------------------------------ environment

    def env(self, **overrides: str) -> dict[str, str]:
        # Only the test services from the root conftest: no DTASK_* setting from the developer's
        # shell (capacity, concurrency, extra task modules...) changes what the processes do.
        keep = {"DTASK_DATABASE_URL", "DTASK_BROKER_URL", "DTASK_REDIS_URL"}
        settings = {**BASE_ENV, **(self.broker.env if self.broker is not None else {}), **overrides}
        # The subprocesses import the code under test from this checkout, whatever is installed.
        return harness.process_env(settings, keep=keep)

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
        node = f"{name}-{uuid.uuid4().hex[:6]}@{os.uname().nodename}"
        if cli:
            argv = harness.dtask_command("worker", "-c", str(concurrency), "-n", node, "--pool", pool)
            return self.harness.spawn(name, argv, self.env(**env), node=node)
        return self.harness.start_worker(name, self.env(**env), node=node, concurrency=concurrency, pool=pool)

    def start_beat(self, name: str = "beat", *, cli: bool = False, **env: str) -> Proc:
        if cli:
            argv = harness.dtask_command("beat", "--schedule", str(self.dir / f"{name}-schedule"))
            return self.harness.spawn(name, argv, self.env(**env))
        return self.harness.start_beat(name, self.env(**env))

    def run_cli(self, *args: str, timeout: float = 60.0, **env: str) -> subprocess.CompletedProcess[str]:
        """Run one `dtask` command to completion (the same entry point as the console script)."""
        return subprocess.run(
            harness.dtask_command(*args),
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

        def alive() -> None:
            if not proc.alive():
                raise AssertionError(f"{proc.name} exited with {proc.popen.returncode} before it was ready")

        await self.harness.wait_answers_ping(app, proc, within=within, interval=0.2, check=alive)

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
        self.harness.stop_all()

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
    return harness.celery_on(broker, "control")


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
