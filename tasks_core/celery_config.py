"""The Celery settings, one function of the settings. Celery is only the transport of task ids:
PostgreSQL owns every task's state, so each setting below is chosen to make the transport fast,
boring and unable to hurt a task. ``celeryconfig`` (beside the packages, where Celery users look)
declares them for the process's settings; any app that talks to our queues applies them.
"""

from __future__ import annotations

import threading
from typing import Any, NoReturn

from celery import Celery
from kombu.entity import Exchange, Queue
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport.base import Transport

from tasks_core.registry import default_registry
from tasks_core.settings import Settings, get_settings

# Long durable work, and the short duties that recover it.
DURABLE_QUEUE = "durable"
DUTIES_QUEUE = "duties"


class BrokerNotConfigured(RuntimeError):
    pass


class NoBrokerTransport(Transport):
    """The broker when DTASK_BROKER_URL is unset: every connection fails, naming the setting.

    No hidden default: Celery alone would fall back to amqp://guest@localhost:5672, a broker that
    may well answer on a shared machine and swallow the task ids.
    """

    driver_type = driver_name = "dtask-no-broker"

    def establish_connection(self) -> NoReturn:
        raise BrokerNotConfigured("DTASK_BROKER_URL is not set (redis://host:6379/0)")


NO_BROKER_URL = "dtask-no-broker://"
TRANSPORT_ALIASES["dtask-no-broker"] = f"{__name__}:NoBrokerTransport"


def broker_settings(url: str, settings: Settings | None = None) -> dict[str, Any]:
    """The settings that depend on the broker: RabbitMQ (amqp://) or Redis (redis://). Also for any
    other app that talks to our queues (a test's or a benchmark's publisher on another broker).
    ``settings`` (default: the process's) gives the longest task's timeout."""
    rabbitmq = url.split("://", 1)[0] in ("amqp", "amqps", "pyamqp")
    if rabbitmq:
        # Quorum queues for `durable` and `duties`: replicated, and they survive a broker node's
        # loss (a lost message would only delay a task: the publisher re-sends it). Celery detects
        # them and turns global QoS off. Queues made on the fly for TaskSpec.queue get the same
        # type. A publish counts only once the broker confirmed it (else the task stays pending and
        # the publisher re-sends it).
        # Acknowledgement and prefetch here: worker_disable_prefetch is Redis-only (Celery ignores
        # it with a warning), so a worker holds up to worker_prefetch_multiplier x concurrency
        # unacknowledged messages (per consumer QoS). Each is acknowledged when a pool process
        # takes it up, before its task runs (task_acks_late off). A message still waiting for a
        # process when its worker dies goes back to the queue and is delivered again; its claim
        # either runs the task or finds it no longer pending, so a second delivery runs nothing twice.
        # RabbitMQ's consumer_timeout (30 min by default) can never cut a durable task short: it
        # only closes a channel holding an unacknowledged delivery, a running task's message was
        # acknowledged when it started, and the lease, not the broker, tells who owns a task. (A
        # message can wait that long for a process only if every process runs a long task, which
        # the default concurrency of capacity + 2 rules out; even then it is just delivered again.)
        queue_args: dict[str, str] | None = {"x-queue-type": "quorum"}
        extra: dict[str, Any] = {
            "task_create_missing_queue_type": "quorum",
            "task_create_missing_queue_exchange_type": "direct",
            "broker_transport_options": {"confirm_publish": True},
            "broker_connection_timeout": 2,
        }
    else:
        # No ack emulation on Redis: a message is gone from the list once a worker pops it, and
        # the acknowledgement costs no Redis round trip. Emulation would keep a copy in an
        # "unacked" hash to restore after visibility_timeout, which early acknowledgement makes
        # pointless (the publisher re-sends a pending task whose message was lost), and its
        # restore-on-reconnect path crashed workers during a Redis restart (kombu: 'NoneType'
        # object has no attribute 'hostname'; found by the fault campaign). visibility_timeout then
        # never applies; it stays above the longest task for anyone who turns emulation and late
        # acks back on. Socket timeouts: a paused Redis fails a publish in seconds instead of
        # hanging its thread forever (workers' BRPOP polls every second, well inside them).
        longest = (settings or get_settings()).max_timeout_seconds
        queue_args = None
        extra = {
            "broker_transport_options": {
                "ack_emulation": False,
                "visibility_timeout": int(longest) + 3600,
                "socket_timeout": 5,
                "socket_connect_timeout": 2,
            }
        }
    # Each queue has its own direct exchange and routing key. Bare Queue(name) objects are both
    # bound to the default exchange under the default key, so any message published by exchange and
    # key (rather than by queue name) was copied into both queues.
    # (kombu is untyped)
    queues = tuple(
        Queue(name, _exchange(name), routing_key=name, queue_arguments=queue_args)  # type: ignore[no-untyped-call]
        for name in (DURABLE_QUEUE, DUTIES_QUEUE)
    )
    return {"broker_url": url, "task_queues": queues, **extra}


def _exchange(name: str) -> Exchange:
    return Exchange(name, type="direct")  # type: ignore[no-untyped-call]


def celery_settings(settings: Settings) -> dict[str, Any]:
    """Every Celery setting of our apps (worker, beat, flower, publishers), for ``settings``."""
    return {
        "broker_connection_retry_on_startup": True,
        # broker_url, task_queues, broker_transport_options...
        **broker_settings(settings.broker_url or NO_BROKER_URL, settings),
        # JSON only: a message is a task id, nothing a pickle could smuggle in.
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "event_serializer": "json",
        # Nothing reads Celery results: the task row holds the outcome. (No result expiry either, so
        # beat schedules no celery.backend_cleanup: built-in tasks are not registered, see
        # celery_app.)
        "task_ignore_result": True,
        "result_backend": None,
        "result_expires": None,
        # Two queues (task_queues, in broker_settings): long durable work, and the short duties that
        # recover it. Every worker consumes both, and its concurrency (capacity + 2 by default)
        # leaves children free for duties, so long tasks can never starve the publisher or the
        # reconciler.
        "task_default_queue": DURABLE_QUEUE,
        "task_routes": {
            "dtask.run": {"queue": DURABLE_QUEUE},
            "dtask.publish": {"queue": DUTIES_QUEUE},
            "dtask.reconcile": {"queue": DUTIES_QUEUE},
            "dtask.prune": {"queue": DUTIES_QUEUE},
            "dtask.schedule": {"queue": DUTIES_QUEUE},
            "dtask.duty": {"queue": DUTIES_QUEUE},
        },
        # Early acknowledgement, no prefetch: a worker holds only the message it is running, so no
        # message waits behind a long task, and nothing sits in Redis' "unacked" set where the
        # visibility timeout would re-deliver it while the first run goes on. A message lost
        # between acknowledgement and claim leaves a pending row that the publisher re-sends within
        # DTASK_PUBLISH_SECONDS. (On RabbitMQ the prefetch is per consumer and cannot be disabled:
        # see broker_settings.)
        "task_acks_late": False,
        "task_reject_on_worker_lost": False,
        "worker_prefetch_multiplier": 1,
        "worker_disable_prefetch": True,
        # No Celery time limits: the durable timeout (task row, enforced by the runtime) is the only
        # one, and it ends the task through its terminal transaction and hooks. A Celery hard limit
        # would kill the process mid-write and leave the reconciler to clean up.
        "task_time_limit": None,
        "task_soft_time_limit": None,
        # A child per task, recycled now and then to bound memory growth in long-lived workers.
        "worker_max_tasks_per_child": 1000,
        # Task events for Flower: received, started, succeeded... from the workers. No "sent" event:
        # every task id is published by our own code (submission, relay after each task,
        # publisher), where a sent event would be a second Redis publish per message (about 0.3 ms
        # of CPU each, docs/benchmarks.md); a task not yet received is pending in PostgreSQL, which
        # the api and dashboard show.
        "worker_send_task_events": True,
        "task_send_sent_event": False,
        "beat_schedule": beat_schedule(settings),
    }


def beat_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    """Beat only schedules; workers run the duties. Each entry expires after its interval, so a
    backlog of duty messages never piles up while workers are down (each duty is also safe to run
    twice)."""
    schedule: dict[str, dict[str, Any]] = {
        "publish-pending": {
            "task": "dtask.publish",
            "schedule": settings.publish_seconds,
            "options": {"queue": DUTIES_QUEUE, "expires": settings.publish_seconds},
        },
        "reconcile-leases": {
            "task": "dtask.reconcile",
            "schedule": settings.reconcile_seconds,
            "options": {"queue": DUTIES_QUEUE, "expires": settings.reconcile_seconds},
        },
        # Durable schedules: their due slots become tasks (one per slot, however many beats run).
        "fire-schedules": {
            "task": "dtask.schedule",
            "schedule": settings.scheduler_seconds,
            "options": {"queue": DUTIES_QUEUE, "expires": settings.scheduler_seconds},
        },
        # Idempotency-Keys past their 24 h, and terminal tasks past DTASK_PRUNE_AFTER_SECONDS (if
        # set). No argument: the worker reads the retention from its own settings (a message cannot
        # lower it).
        "prune": {
            "task": "dtask.prune",
            "schedule": 3600.0,
            "options": {"queue": DUTIES_QUEUE, "expires": 3600.0},
        },
    }
    # The domains' own duties (DUTIES beside their SPECS), each every Settings.<every> seconds;
    # unset: off.
    for duty in default_registry(settings.extra_modules).duties():
        every = getattr(settings, duty.every)
        if every:
            schedule[f"duty-{duty.name}"] = {
                "task": "dtask.duty",
                "schedule": float(every),
                "args": (duty.name,),
                "options": {"queue": DUTIES_QUEUE, "expires": float(every)},
            }
    return schedule


_default_app: Celery | None = None
_default_lock = threading.Lock()


def default_app() -> Celery:
    """This process's publishing app, for the process's settings, made on first use (an api or a
    command that never publishes never configures one). Not the current app: the worker's own
    (``tasks_core.celery_app``) stays that in a process that has both."""
    global _default_app
    with _default_lock:
        if _default_app is None:
            app = Celery("durable_tasks", set_as_current=False)
            app.conf.update(celery_settings(get_settings()))
            _default_app = app
        return _default_app
