"""The Celery app (`celery -A tasks_core.celery_app worker|beat|flower`): the one place the runtime
is wired to Celery. It builds the app from ``celeryconfig``, hands the app down as the workers'
transport, connects Celery's signals and names the tasks; what each task does lives with what it
runs (``tasks_core.worker.process``, ``tasks_core.duties.messages``). Nothing in the runtime imports
this module.

Each worker process owns one asyncio loop (``tasks_core.worker.loop``, in a thread of its own) and
one database pool, created after fork on first use, never at import or in the parent. Every Celery
task runs its coroutine on that loop, so a task's heartbeat runs beside its handler; the dense mode
(``--pool threads``) runs many tasks at once on it.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, bootsteps
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
from tasks_core.duties import messages
from tasks_core.settings import Settings
from tasks_core.transport import CeleryTransport
from tasks_core.worker.loop import WorkerLoop
from tasks_core.worker.process import (
    CHILD_SHUTDOWN_SIGNAL,
    SUPPORTED_POOLS,
    WorkerProcess,
    refuse_stale_schema,
)

__all__ = ["CHILD_SHUTDOWN_SIGNAL", "OUR_TASKS", "SUPPORTED_POOLS", "app", "process_state"]

app = Celery("durable_tasks")
app.config_from_object("celeryconfig")
OUR_TASKS = frozenset(
    {"dtask.run", "dtask.publish", "dtask.reconcile", "dtask.prune", "dtask.duty", "dtask.schedule"}
)


def _transport(settings: Settings) -> CeleryTransport:
    return CeleryTransport(app, timeout=settings.publish_timeout_seconds)


worker = WorkerProcess(_transport)


def process_state() -> WorkerLoop:
    """This process's loop, created on first use (after fork, in a prefork child)."""
    return worker.state()


@app.on_after_finalize.connect
def _only_our_tasks(sender: Celery, **_: Any) -> None:
    """Celery registers built-in tasks (celery.accumulate, celery.chord_unlock, ...) in every app.
    We use none of them, and anyone who can write to the broker could run them: a message naming
    anything but our own tasks is discarded as unregistered."""
    for name in [n for n in sender.tasks if n not in OUR_TASKS]:
        sender.tasks.unregister(name)


class WatchPoolChildren(bootsteps.StartStopStep):  # type: ignore[misc]
    """A prefork worker's main process learns of every pool child that exits (``watch_pool``). The
    pool sets its callbacks while it registers with the event loop (again after a broker
    reconnection), so they are wrapped on the loop's next turn, after every step registered."""

    requires = ("celery.worker.components:Pool",)

    def register_with_event_loop(self, w: Any, hub: Any) -> None:
        hub.call_soon(worker.watch_pool, w.pool)


app.steps["worker"].add(WatchPoolChildren)


@after_setup_logger.connect
@after_setup_task_logger.connect
def _truncate_logs(logger: logging.Logger | None = None, **_: Any) -> None:
    logs.install(logger)


@worker_init.connect
def _check_pool_and_schema_on_start(sender: Any = None, **_: Any) -> None:
    worker.started(sender)


@beat_init.connect
def _check_schema_on_beat_start(**_: Any) -> None:
    # `celery -A tasks_core.celery_app beat` bypasses `dtask beat`'s gate: beat refuses a stale
    # schema too, whichever command started it.
    refuse_stale_schema("dtask beat")


@worker_process_init.connect
def _init_process(**_: Any) -> None:
    worker.state()


@worker_process_shutdown.connect
def _close_process(**_: Any) -> None:
    worker.close()


@worker_shutdown.connect
def _close_main_process(**_: Any) -> None:
    # Solo and threads pools run tasks in the main process: close its loop as the worker stops.
    worker.close()


@worker_shutting_down.connect
def _on_shutting_down(**_: Any) -> None:
    worker.shutting_down()


@app.task(name="dtask.run", ignore_result=True)
def run(task_id: Any) -> str:
    return worker.run(task_id)


@app.task(name="dtask.publish", ignore_result=True)
def publish() -> dict[str, int]:
    state = worker.state()
    return state.run(messages.publish(state.services))


@app.task(name="dtask.schedule", ignore_result=True)
def schedule() -> dict[str, int]:
    state = worker.state()
    return state.run(messages.schedule(state.services))


@app.task(name="dtask.reconcile", ignore_result=True)
def reconcile() -> dict[str, Any]:
    state = worker.state()
    return state.run(messages.reconcile(state.services))


@app.task(name="dtask.prune", ignore_result=True)
def prune(older_than_seconds: Any = None) -> dict[str, int]:
    well_formed, requested = messages.prune_request(older_than_seconds)
    if not well_formed:
        return {}
    state = worker.state()
    return state.run(messages.prune(state.services, requested))


@app.task(name="dtask.duty", ignore_result=True)
def duty(name: Any) -> Any:
    state = worker.state()
    return state.run(messages.duty(state.services, name))
