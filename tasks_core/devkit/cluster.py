"""The one cluster harness: real ``celery worker``/``beat`` (and ``dtask``) processes for given
settings, a Celery app on their broker, and the wait until a worker answers a ping.

The bench (``bench.common.BenchEnv``), the fault campaign (``chaos.faults.Processes``) and the
system tests (``tests/system/conftest.Cluster``) each wrap a ``Cluster``; they differ only in the
settings they give, what their processes record and how they report a timeout. Processes run as
an operator runs them (the command lines come from ``tasks_core.ops.commands``, as ``dtask worker``
builds them), in sessions of their own (``processes.spawn``), importing the code of this checkout,
with a working directory outside it so no developer ``.env`` is read.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import tasks_core
from tasks_core.devkit.processes import GroupProcess, kill_group, spawn
from tasks_core.ops.commands import CELERY_APP, beat_args, celery_command, worker_args

# The checkout the subprocesses must import (the same code as this process, whatever is installed).
ROOT = Path(tasks_core.__file__).resolve().parent.parent
DEFAULT_QUEUES = ("durable", "duties")

T = TypeVar("T")


def process_env(
    settings: Mapping[str, str], *, strip: tuple[str, ...] = ("DTASK_",), keep: Iterable[str] = ()
) -> dict[str, str]:
    """This process's environment without the variables starting with ``strip`` (but ``keep``),
    plus exactly ``settings``; the child imports this checkout and writes its output unbuffered."""
    kept = set(keep)
    env = {k: v for k, v in os.environ.items() if not k.startswith(strip) or k in kept}
    env.update(settings)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def dtask_command(*args: str) -> list[str]:
    """A ``dtask`` command (the console script's entry point) as a subprocess of this interpreter."""
    return [sys.executable, "-m", "tasks_core.ops.cli", *args]


def celery_on(broker: str, name: str) -> Any:
    """A Celery app with the project's settings on ``broker`` (to publish, and for remote control:
    ping, consumers), declaring the queues as the workers do (quorum on RabbitMQ). It is not
    ``tasks_core.celery_app.app``, whose broker comes from the caller's environment."""
    from celery import Celery

    app = Celery(name, set_as_current=False)
    app.config_from_object("celeryconfig")
    # By name, as Celery loads it: celeryconfig sits beside the packages, outside mypy's scope.
    settings = importlib.import_module("celeryconfig").broker_settings(broker)
    app.conf.update(settings, beat_schedule={})
    return app


def answers_ping(app: Any, node: str, timeout: float) -> bool:
    """Whether the worker ``node`` answers a remote-control ping addressed to it."""
    replies = app.control.ping(destination=[node], timeout=timeout)
    return any(node in reply for reply in replies or [])


async def poll(
    probe: Callable[[], Awaitable[T | None]],
    *,
    within: float,
    interval: float,
    what: str,
    check: Callable[[], None] | None = None,
    error: Callable[[str], Exception] = AssertionError,
) -> T:
    """Call ``probe`` until it returns something other than None/False (``check`` first, each
    time, to fail early); ``error`` raised after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        if check is not None:
            check()
        value = await probe()
        if value is not None and value is not False:
            return value
        if time.monotonic() >= deadline:
            raise error(f"timed out after {within:g} s waiting for {what}")
        await asyncio.sleep(interval)


@dataclass
class ClusterProcess(GroupProcess):
    """A started process with its command line; a worker knows its node name."""

    argv: list[str] = field(default_factory=list)
    node: str | None = None


P = TypeVar("P", bound=ClusterProcess)


class Cluster(Generic[P]):
    """Processes started in ``workdir`` (logs under ``logs``, by default the same), each recorded
    as a ``process`` (a ClusterProcess subclass); ``stop_all`` kills every group started."""

    def __init__(self, workdir: Path, process: type[P], *, logs: Path | None = None) -> None:
        self.dir = workdir
        self.logs = logs or workdir
        self.process = process
        self.procs: list[P] = []

    def spawn(self, name: str, argv: Sequence[str], env: Mapping[str, str], **fields: Any) -> P:
        log = self.logs / f"{name}.log"
        popen = spawn(argv, env=env, log=log, cwd=self.dir)
        proc = self.process(name, popen, log, argv=list(argv), **fields)
        self.procs.append(proc)
        return proc

    def start_worker(
        self,
        name: str,
        env: Mapping[str, str],
        *,
        node: str,
        concurrency: int,
        pool: str = "prefork",
        queues: Sequence[str] = DEFAULT_QUEUES,
        loglevel: str = "INFO",
        app: str = CELERY_APP,
        **fields: Any,
    ) -> P:
        """``celery -A app worker`` without neighbour discovery, which only slows start-up."""
        args = worker_args(
            queues=queues, concurrency=concurrency, pool=pool, loglevel=loglevel, node=node, neighbours=False
        )
        return self.spawn(name, celery_command(args, app=app), env, node=node, **fields)

    def start_beat(self, name: str, env: Mapping[str, str], *, loglevel: str = "INFO", **fields: Any) -> P:
        schedule = str(self.dir / f"{name}-schedule")
        argv = celery_command(beat_args(schedule=schedule, loglevel=loglevel))
        return self.spawn(name, argv, env, **fields)

    def start_api(self, name: str, env: Mapping[str, str], *, port: int, host: str = "127.0.0.1") -> P:
        return self.spawn(name, dtask_command("api", "--host", host, "--port", str(port)), env)

    async def wait_answers_ping(
        self,
        app: Any,
        proc: P,
        *,
        within: float,
        interval: float,
        ping_timeout: float = 0.5,
        check: Callable[[], None] | None = None,
        error: Callable[[str], Exception] = AssertionError,
    ) -> float:
        """Seconds until ``proc`` answers a ping addressed to its own node name, through ``app``."""
        started = time.monotonic()
        node = proc.node
        assert node is not None, f"{proc.name} is no worker"

        async def answered() -> bool:
            return await asyncio.to_thread(answers_ping, app, node, ping_timeout)

        await poll(
            answered, within=within, interval=interval, what=f"{proc.name} to answer a ping", check=check,
            error=error,
        )
        return time.monotonic() - started

    def stop_all(self) -> None:
        """SIGCONT (a stopped group cannot die otherwise) and SIGKILL every group started, then reap."""
        for proc in self.procs:
            proc.signal_group(signal.SIGCONT)
            proc.signal_group(signal.SIGKILL)
        for proc in self.procs:
            kill_group(proc.popen)

