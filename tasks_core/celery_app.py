"""The Celery app (`celery -A tasks_core.celery_app worker|beat|flower`) and its tasks.

Each worker process owns one asyncio loop (an ``asyncio.Runner``) and one database pool, created
after fork on first use, never at import or in the parent. Every Celery task runs its coroutine
on that loop, so a task's heartbeat runs beside its handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from celery import Celery
from celery.signals import (
    after_setup_logger,
    after_setup_task_logger,
    beat_init,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_shutting_down,
)

from tasks_core import logs, metrics
from tasks_core.runtime import ShutdownSignal

log = logging.getLogger(__name__)
T = TypeVar("T")

app = Celery("durable_tasks")
app.config_from_object("celeryconfig")
OUR_TASKS = frozenset({"dtask.run", "dtask.publish", "dtask.reconcile", "dtask.prune"})


@app.on_after_finalize.connect
def _only_our_tasks(sender: Celery, **_: Any) -> None:
    """Celery registers built-in tasks (celery.accumulate, celery.chord_unlock, ...) in every app.
    We use none of them, and anyone who can write to the broker could run them: a message naming
    anything but our own tasks is discarded as unregistered."""
    for name in [n for n in sender.tasks if n not in OUR_TASKS]:
        sender.tasks.unregister(name)


@after_setup_logger.connect
@after_setup_task_logger.connect
def _truncate_logs(logger: logging.Logger | None = None, **_: Any) -> None:
    logs.install(logger)

# The signal a worker's main process sends its pool children to start the durable shutdown.
# (Billiard uses SIGTERM/SIGUSR1 itself.)
CHILD_SHUTDOWN_SIGNAL = signal.SIGUSR2


# The worker's Celery node name (``-n``), captured in the main process before the pool forks.
_node_name: str | None = None


class ProcessState:
    def __init__(self) -> None:
        from tasks_core.services import build_services
        from tasks_core.settings import get_settings

        self.pid = os.getpid()
        self.runner = asyncio.Runner()
        self.shutdown = ShutdownSignal()
        # Connections are opened lazily, inside this process's loop. The attempts audit trail
        # (and the readiness fact) name the exact worker process, not just the machine: several
        # workers share a host, and operators must tell which one owned an attempt.
        extra = {"worker_name": f"{_node_name}:{self.pid}"} if _node_name else None
        self.services = build_services(get_settings(), pool_size=3, extra=extra, pre_ping=False)
        # An unresponsive handler was left running in this loop: the process must be recycled.
        self.abandoned = False
        self.flushed_at = 0.0

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            return self.runner.run(coro)
        finally:
            # At most every DTASK_METRICS_FLUSH_SECONDS: a flush per task is a Redis round trip
            # per task. The last deltas go when the process stops.
            if time.monotonic() - self.flushed_at >= self.services.settings.metrics_flush_seconds:
                self.runner.run(self._flush_metrics())

    async def _flush_metrics(self) -> None:
        self.flushed_at = time.monotonic()
        try:
            await metrics.flush(self.services.redis)
        except Exception:  # metrics must never fail a task; the deltas wait for the next flush
            log.warning("could not flush metrics to Redis", exc_info=True)

    def request_shutdown(self) -> None:
        self.runner.get_loop().call_soon_threadsafe(self.shutdown.set)

    def close(self) -> None:
        try:
            self.runner.run(self._flush_metrics())
            self.runner.run(self.services.close())
        finally:
            # Runner.close() waits for every task left in the loop to finish its cancellation; a
            # handler that ignores cancellation would hold the process forever. Then the process
            # exits without closing the loop.
            if not self.abandoned:
                self.runner.close()


_state: ProcessState | None = None


def process_state() -> ProcessState:
    global _state
    if _state is None or _state.pid != os.getpid():
        _state = ProcessState()
        if _is_pool_child():
            signal.signal(CHILD_SHUTDOWN_SIGNAL, _on_child_shutdown_signal)
    return _state


def _on_child_shutdown_signal(*_: Any) -> None:
    if _state is not None:
        _state.request_shutdown()


def _is_pool_child() -> bool:
    from billiard.process import current_process

    return bool(current_process()._name != "MainProcess")


@worker_init.connect
def _check_schema_on_start(sender: Any = None, **_: Any) -> None:
    """Fail closed: a worker never runs against a schema it was not written for."""
    global _node_name
    _node_name = getattr(sender, "hostname", None)
    _fail_closed_on_schema("dtask worker")


@beat_init.connect
def _check_schema_on_beat_start(**_: Any) -> None:
    # `celery -A tasks_core.celery_app beat` bypasses `dtask beat`'s gate; design §7 wants beat to
    # refuse a stale schema too, whichever command started it.
    _fail_closed_on_schema("dtask beat")


def _fail_closed_on_schema(process: str) -> None:
    from tasks_core.db import SchemaNotCurrent, check_schema_blocking
    from tasks_core.settings import get_settings

    try:
        check_schema_blocking(get_settings().require_database())
    except SchemaNotCurrent as exc:
        print(f"{process}: refusing to start: {exc}", file=sys.stderr, flush=True)
        os._exit(2)


@worker_process_init.connect
def _init_process(**_: Any) -> None:
    process_state()


@worker_process_shutdown.connect
def _close_process(**_: Any) -> None:
    global _state
    if _state is not None and _state.pid == os.getpid():
        _state.close()
        _state = None


@worker_shutting_down.connect
def _on_shutting_down(**_: Any) -> None:
    """Warm shutdown: tell every running handler (grace period, then a terminal write)."""
    if _state is not None and _state.pid == os.getpid():  # solo pool: tasks run here
        _state.request_shutdown()
    from billiard.process import active_children

    for child in active_children():
        if child.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, CHILD_SHUTDOWN_SIGNAL)


@app.task(name="dtask.run", ignore_result=True)
def run(task_id: Any) -> str:
    from tasks_core.runtime import HandlerUnresponsive, run_task

    state = process_state()
    try:
        return state.run(run_task(state.services, task_id, state.shutdown)).status
    except HandlerUnresponsive as exc:
        # The handler still runs in this process's event loop and would run on during the next
        # task. Its attempt has ended; recycle the process (billiard reports the SystemExit as this
        # job's result and starts a fresh child). The solo pool has no child to recycle.
        state.abandoned = True
        if _is_pool_child():
            log.error("recycling this pool process: an unresponsive handler still runs in it")
            raise SystemExit(1) from exc
        log.error("an unresponsive handler keeps running in this solo worker; restart it to stop it")
        return str(exc.args[0])


@app.task(name="dtask.publish", ignore_result=True)
def publish() -> dict[str, int]:
    from tasks_core.publisher import publish_pending

    state = process_state()
    return vars(state.run(publish_pending(state.services)))


@app.task(name="dtask.reconcile", ignore_result=True)
def reconcile() -> dict[str, Any]:
    from tasks_core.reconciler import reconcile as run_reconcile

    state = process_state()
    return vars(state.run(run_reconcile(state.services)))


@app.task(name="dtask.prune", ignore_result=True)
def prune(older_than_seconds: Any = None) -> dict[str, int]:
    """Forget expired Idempotency-Keys; delete terminal tasks older than the retention
    (DTASK_PRUNE_AFTER_SECONDS). A message may ask for an older cutoff, never a younger one: anyone
    who can write to the broker could otherwise wipe the history (prune(1e-9))."""
    from tasks_core.pruner import prune as run_prune

    requested: float | None = None
    if older_than_seconds is not None:
        if (
            not isinstance(older_than_seconds, int | float)
            or isinstance(older_than_seconds, bool)
            or not math.isfinite(older_than_seconds)
        ):
            log.warning("dropping prune message with bad age %s", logs.short(older_than_seconds))
            return {}
        requested = float(older_than_seconds)
    state = process_state()
    return vars(state.run(run_prune(state.services, requested)))
