"""A worker process as Celery runs it: what its main process learnt at start-up (node name, pool,
concurrency), its one ``WorkerLoop`` (created after fork, on first use: never at import or in a
prefork parent), the durable shutdown it passes on to its pool children, and the body of
``dtask.run``. The Celery app (``tasks_core.celery_app``) connects the signals and hands down how
to publish.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from billiard.process import active_children, current_process

from tasks_core.db import SchemaNotCurrent, check_schema_blocking
from tasks_core.services import Transport
from tasks_core.settings import Settings, get_settings
from tasks_core.worker import dead_owners
from tasks_core.worker.loop import WorkerLoop
from tasks_core.worker.runtime import HandlerUnresponsive, run_task

log = logging.getLogger(__name__)

# prefork: a task per child process; solo: one at a time; threads: the dense mode, many tasks per
# process on one event loop. Others (gevent, eventlet, processes...) are refused at start-up.
SUPPORTED_POOLS = ("concurrency.prefork", "concurrency.solo", "concurrency.thread")

# The signal a worker's main process sends its pool children to start the durable shutdown.
# (Billiard uses SIGTERM/SIGUSR1 itself.)
CHILD_SHUTDOWN_SIGNAL = signal.SIGUSR2


def is_pool_child() -> bool:
    return bool(current_process()._name != "MainProcess")


def refuse_stale_schema(process: str) -> None:
    """Fail closed: a worker (or beat) never runs against a schema it was not written for."""
    try:
        check_schema_blocking(get_settings().require_database())
    except SchemaNotCurrent as exc:
        print(f"{process}: refusing to start: {exc}", file=sys.stderr, flush=True)
        os._exit(2)


class WorkerProcess:
    def __init__(self, transport: Callable[[Settings], Transport]) -> None:
        self._transport = transport
        # Captured in the worker's main process (before a prefork pool forks): the Celery node name
        # (``-n``), whether the pool is the dense mode (threads), and its concurrency.
        self.node_name: str | None = None
        self.dense = False
        self.concurrency = 1
        self._state: WorkerLoop | None = None
        self._lock = threading.Lock()

    def started(self, worker: Any) -> None:
        """The worker's main process starts: refuse an unsupported pool or a stale schema."""
        self.node_name = getattr(worker, "hostname", None)
        pool = getattr(worker, "pool_cls", None)
        pool_name = f"{getattr(pool, '__module__', '')}.{getattr(pool, '__name__', pool)}"
        if not any(kind in pool_name for kind in SUPPORTED_POOLS):
            print(f"dtask worker: refusing to start: pool {pool_name} is not supported "
                  f"(use prefork, solo or threads)", file=sys.stderr, flush=True)
            os._exit(2)
        self.dense = "concurrency.thread" in pool_name
        self.concurrency = int(getattr(worker, "concurrency", 1) or 1)
        refuse_stale_schema("dtask worker")
        # Before this worker runs or forks anything: the tasks an earlier, dead process under this
        # node name still holds (this worker restarted after a crash) are freed now, not at their
        # leases' end.
        if self.node_name and dead_owners.node_is_local(self.node_name):
            dead_owners.expire_dead_blocking(
                get_settings().require_database(), self.node_name,
                lambda pid: not dead_owners.pid_exists(pid), why="worker start-up",
            )

    def watch_pool(self, pool: Any) -> None:
        """In a prefork worker's main process, once its pool is registered with the event loop: run
        ``child_exited`` whenever billiard reaps a pool child (its ``on_process_down`` callback,
        which the pool calls before it starts a replacement)."""
        inner = getattr(getattr(pool, "_pool", None), "on_process_down", None)
        if inner is None or getattr(inner, "dtask_watched", False):
            return

        def on_process_down(proc: Any) -> None:
            inner(proc)
            self.child_exited(getattr(proc, "pid", None), getattr(proc, "exitcode", None))

        on_process_down.dtask_watched = True  # type: ignore[attr-defined]
        pool._pool.on_process_down = on_process_down

    def child_exited(self, pid: int | None, exitcode: int | None) -> None:
        """A pool child is gone: the attempts it still held are expired at once. A child that exited
        cleanly (shutdown, recycling) ended its attempts itself."""
        if not pid or exitcode == 0 or not self.node_name:
            return
        try:
            dead_owners.expire_dead_blocking(
                get_settings().require_database(), self.node_name, lambda p: p == pid,
                why=f"pool process {pid} exited ({exitcode})",
            )
        except Exception:  # never break billiard's pool maintenance
            log.exception("expiring the attempts of pool process %s failed", pid)

    def state(self) -> WorkerLoop:
        """This process's loop, created on first use (after fork, in a prefork child)."""
        with self._lock:
            if self._state is None or self._state.pid != os.getpid():
                settings = get_settings()
                # The attempts audit trail (and the readiness fact) name the exact worker process,
                # not just the machine: several workers share a host, and operators must tell which
                # one owned an attempt.
                name = dead_owners.worker_name(self.node_name, os.getpid()) if self.node_name else None
                self._state = WorkerLoop(
                    settings, worker_name=name, dense=self.dense, concurrency=self.concurrency,
                    transport=self._transport(settings),
                )
                if is_pool_child():
                    signal.signal(CHILD_SHUTDOWN_SIGNAL, self._on_child_shutdown_signal)
            return self._state

    def _on_child_shutdown_signal(self, *_: Any) -> None:
        if self._state is not None:
            self._state.request_shutdown()

    def close(self) -> None:
        """This process stops: close its loop (a prefork child, or the main process of the solo
        and threads pools, which run tasks themselves)."""
        if self._state is not None and self._state.pid == os.getpid():
            self._state.close()
            self._state = None

    def shutting_down(self) -> None:
        """Warm shutdown: tell every running handler (grace period, then a terminal write)."""
        if self._state is not None and self._state.pid == os.getpid():  # solo and threads pools
            self._state.request_shutdown()
        for child in active_children():
            if child.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, CHILD_SHUTDOWN_SIGNAL)

    def run(self, task_id: Any) -> str:
        """``dtask.run``: the task a message names; its outcome's status."""
        state = self.state()
        try:
            return state.run(run_task(state.services, task_id, state.shutdown)).status
        except HandlerUnresponsive as exc:
            # The handler still runs in this process's event loop. Its attempt has ended; a prefork
            # child is recycled (billiard reports the SystemExit as this job's result and starts a
            # fresh child). The solo and threads pools share the process with other work: the
            # handler is left to finish on its own, its writes all refused.
            state.abandoned = True
            if is_pool_child():
                log.error("recycling this pool process: an unresponsive handler still runs in it")
                raise SystemExit(1) from exc
            log.error("an unresponsive handler keeps running in this worker; restart it to stop it")
            return str(exc.args[0])
