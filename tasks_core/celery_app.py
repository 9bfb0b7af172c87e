"""The Celery app (`celery -A tasks_core.celery_app worker|beat|flower`) and its tasks.

Each worker process owns one asyncio loop (``tasks_core.worker.loop``, in a thread of its own) and
one database pool, created after fork on first use, never at import or in the parent. Every Celery
task runs its coroutine on that loop, so a task's heartbeat runs beside its handler; the dense mode
(``--pool threads``) runs many tasks at once on it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import threading
from typing import Any

from celery import Celery
from celery.signals import (
    after_setup_logger,
    after_setup_task_logger,
    beat_init,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_shutdown,
    worker_shutting_down,
)

from tasks_core import logs
from tasks_core.worker.loop import WorkerLoop

log = logging.getLogger(__name__)
# prefork: a task per child process; solo: one at a time; threads: the dense mode, many tasks per
# process on one event loop. Others (gevent, eventlet, processes...) are refused at start-up.
SUPPORTED_POOLS = ("concurrency.prefork", "concurrency.solo", "concurrency.thread")

app = Celery("durable_tasks")
app.config_from_object("celeryconfig")
OUR_TASKS = frozenset({"dtask.run", "dtask.publish", "dtask.reconcile", "dtask.prune", "dtask.duty"})


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


# Captured in the worker's main process (before a prefork pool forks): the Celery node name
# (``-n``), whether the pool is the dense mode (threads), and its concurrency.
_node_name: str | None = None
_dense = False
_concurrency = 1

_state: WorkerLoop | None = None
_state_lock = threading.Lock()


def process_state() -> WorkerLoop:
    """This process's loop, created on first use (after fork, in a prefork child)."""
    global _state
    with _state_lock:
        if _state is None or _state.pid != os.getpid():
            from tasks_core.settings import get_settings

            # The attempts audit trail (and the readiness fact) name the exact worker process, not
            # just the machine: several workers share a host, and operators must tell which one
            # owned an attempt.
            name = f"{_node_name}:{os.getpid()}" if _node_name else None
            _state = WorkerLoop(get_settings(), worker_name=name, dense=_dense, concurrency=_concurrency)
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
    global _node_name, _dense, _concurrency
    _node_name = getattr(sender, "hostname", None)
    pool = getattr(sender, "pool_cls", None)
    pool_name = f"{getattr(pool, '__module__', '')}.{getattr(pool, '__name__', pool)}"
    if not any(kind in pool_name for kind in SUPPORTED_POOLS):
        print(f"dtask worker: refusing to start: pool {pool_name} is not supported "
              f"(use prefork, solo or threads)", file=sys.stderr, flush=True)
        os._exit(2)
    _dense = "concurrency.thread" in pool_name
    _concurrency = int(getattr(sender, "concurrency", 1) or 1)
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


@worker_shutdown.connect
def _close_main_process(**_: Any) -> None:
    # Solo and threads pools run tasks in the main process: close its loop as the worker stops.
    _close_process()


@worker_shutting_down.connect
def _on_shutting_down(**_: Any) -> None:
    """Warm shutdown: tell every running handler (grace period, then a terminal write)."""
    if _state is not None and _state.pid == os.getpid():  # solo and threads pools: tasks run here
        _state.request_shutdown()
    from billiard.process import active_children

    for child in active_children():
        if child.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, CHILD_SHUTDOWN_SIGNAL)


@app.task(name="dtask.run", ignore_result=True)
def run(task_id: Any) -> str:
    from tasks_core.worker.runtime import HandlerUnresponsive, run_task

    state = process_state()
    try:
        return state.run(run_task(state.services, task_id, state.shutdown)).status
    except HandlerUnresponsive as exc:
        # The handler still runs in this process's event loop. Its attempt has ended; a prefork
        # child is recycled (billiard reports the SystemExit as this job's result and starts a
        # fresh child). The solo and threads pools share the process with other work: the handler
        # is left to finish on its own, its writes all refused.
        state.abandoned = True
        if _is_pool_child():
            log.error("recycling this pool process: an unresponsive handler still runs in it")
            raise SystemExit(1) from exc
        log.error("an unresponsive handler keeps running in this worker; restart it to stop it")
        return str(exc.args[0])


@app.task(name="dtask.publish", ignore_result=True)
def publish() -> dict[str, int]:
    from tasks_core.duties.publisher import publish_pending

    state = process_state()
    return vars(state.run(publish_pending(state.services)))


@app.task(name="dtask.reconcile", ignore_result=True)
def reconcile() -> dict[str, Any]:
    from tasks_core.duties.reconciler import reconcile as run_reconcile

    state = process_state()
    return vars(state.run(run_reconcile(state.services)))


@app.task(name="dtask.prune", ignore_result=True)
def prune(older_than_seconds: Any = None) -> dict[str, int]:
    """Forget expired Idempotency-Keys; delete terminal tasks older than the retention
    (DTASK_PRUNE_AFTER_SECONDS). A message may ask for an older cutoff, never a younger one: anyone
    who can write to the broker could otherwise wipe the history (prune(1e-9))."""
    from tasks_core.duties.pruner import prune as run_prune

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


@app.task(name="dtask.duty", ignore_result=True)
def duty(name: Any) -> Any:
    """A domain's periodic duty (TaskSpec modules' DUTIES), by name; an unknown name is dropped."""
    state = process_state()
    fn = state.services.registry.duty(name) if isinstance(name, str) else None
    if fn is None:
        log.warning("dropping duty message for unknown duty %s", logs.short(name))
        return {}
    return state.run(fn(state.services))
