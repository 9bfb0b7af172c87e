"""Celery settings (`app.config_from_object("celeryconfig")`), declared for this process's settings.

Each value and the reason for it is in ``tasks_core.celery_config.celery_settings``; this module only
names them, where Celery users look for them.
"""

from celery.app.defaults import DEFAULTS

from tasks_core.celery_config import (  # noqa: F401  (re-exported for apps on another broker)
    BrokerNotConfigured,
    NoBrokerTransport,
    broker_settings,
    celery_settings,
)
from tasks_core.settings import get_settings

_conf = celery_settings(get_settings())

broker_connection_retry_on_startup = _conf["broker_connection_retry_on_startup"]
broker_url = _conf["broker_url"]
task_queues = _conf["task_queues"]
broker_transport_options = _conf["broker_transport_options"]
# Set for RabbitMQ only (see broker_settings); on Redis, Celery's own defaults.
broker_connection_timeout = _conf.get("broker_connection_timeout", DEFAULTS["broker_connection_timeout"])
task_create_missing_queue_type = _conf.get(
    "task_create_missing_queue_type", DEFAULTS["task_create_missing_queue_type"]
)
task_create_missing_queue_exchange_type = _conf.get(
    "task_create_missing_queue_exchange_type", DEFAULTS["task_create_missing_queue_exchange_type"]
)

task_serializer = _conf["task_serializer"]
result_serializer = _conf["result_serializer"]
accept_content = _conf["accept_content"]
event_serializer = _conf["event_serializer"]

task_ignore_result = _conf["task_ignore_result"]
result_backend = _conf["result_backend"]
result_expires = _conf["result_expires"]

task_default_queue = _conf["task_default_queue"]
task_routes = _conf["task_routes"]

task_acks_late = _conf["task_acks_late"]
task_reject_on_worker_lost = _conf["task_reject_on_worker_lost"]
worker_prefetch_multiplier = _conf["worker_prefetch_multiplier"]
worker_disable_prefetch = _conf["worker_disable_prefetch"]

task_time_limit = _conf["task_time_limit"]
task_soft_time_limit = _conf["task_soft_time_limit"]

worker_max_tasks_per_child = _conf["worker_max_tasks_per_child"]

worker_send_task_events = _conf["worker_send_task_events"]
task_send_sent_event = _conf["task_send_sent_event"]

beat_schedule = _conf["beat_schedule"]
