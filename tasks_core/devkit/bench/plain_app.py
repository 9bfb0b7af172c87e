"""The baseline: a plain Celery no-op app with exactly the project's transport settings.

`celery -A tasks_core.devkit.bench.plain_app worker -Q durable,duties ...` — the same celeryconfig (broker
from DTASK_BROKER_URL, JSON, early acks, prefetch disabled, events on, child recycling), the same
queues, pool and concurrency as the durable worker; only the task differs. It touches no database:
each run increments a Redis counter and keeps the latest completion time, which is how the bench
knows when all N are done (one small Lua call, so the bookkeeping costs one Redis round trip).
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

from tasks_core.transport import DURABLE_QUEUE

NOOP = "bench.noop"
DONE_KEY = "dtask:bench:plain:done"
LAST_KEY = "dtask:bench:plain:last"

# INCR the counter and keep the largest completion time (children finish out of order).
_DONE_LUA = """
redis.call('INCR', KEYS[1])
local last = redis.call('GET', KEYS[2])
if (not last) or tonumber(ARGV[1]) > tonumber(last) then redis.call('SET', KEYS[2], ARGV[1]) end
return 1
"""

app = Celery("dtask_bench_plain")
app.config_from_object("celeryconfig")
# No beat schedule and no durable tasks here: only the transport settings are shared.
app.conf.update(beat_schedule={}, task_routes={NOOP: {"queue": DURABLE_QUEUE}})

_client: tuple[int, Any] | None = None


def _script() -> Any:
    """One Redis client per pool child, made after fork (a client inherited across fork is shared)."""
    global _client
    if _client is None or _client[0] != os.getpid():
        import redis

        # The bench's Redis DB (DTASK_REDIS_URL), also when the broker is RabbitMQ.
        conn = redis.Redis.from_url(os.environ.get("DTASK_REDIS_URL") or app.conf.broker_url)
        _client = (os.getpid(), conn.register_script(_DONE_LUA))
    return _client[1]


@app.task(name=NOOP, ignore_result=True)  # type: ignore[untyped-decorator]  # Celery is untyped
def noop() -> None:
    _script()(keys=[DONE_KEY, LAST_KEY], args=[repr(time.time())])


def publish(client_app: Any, n: int) -> float:
    """Publish ``n`` no-ops the way ``CeleryTransport`` publishes task ids (one producer, a loop);
    the wall-clock time just before the first one."""
    with client_app.producer_or_acquire() as producer:
        started = time.time()
        for _ in range(n):
            client_app.send_task(NOOP, queue=DURABLE_QUEUE, producer=producer)
    return started
