"""Publishing task ids through Celery: the only thing the broker ever carries."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from celery import Celery

from tasks_core.celery_config import DURABLE_QUEUE, DUTIES_QUEUE, default_app

__all__ = ["DURABLE_QUEUE", "DUTIES_QUEUE", "RUN_TASK", "CeleryTransport"]

RUN_TASK = "dtask.run"

# A publish that cannot reach the broker fails fast: the pending row is already committed and
# the publisher re-sends it, so waiting here would only stall the submitter.
RETRY_POLICY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}


# Publishing blocks (kombu is synchronous), so it runs in threads of its own: a hung broker can tie
# these up, never the default executor that handlers' blocking client calls rely on.
_PUBLISHERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dtask-publish")


class CeleryTransport:
    def __init__(self, app: Celery | None = None, *, timeout: float | None = None) -> None:
        """Publish through ``app``: the worker's own (``tasks_core.celery_app`` hands it down), or,
        by default, the process's publishing app."""
        self.app = app if app is not None else default_app()
        self.timeout = timeout

    async def publish(self, task_ids: list[str], queue: str = DURABLE_QUEUE) -> None:
        """Publish off the event loop, within ``timeout`` seconds (TimeoutError past it: the
        publish may still complete later, which at-least-once delivery allows)."""
        if task_ids:
            loop = asyncio.get_running_loop()
            sending = loop.run_in_executor(_PUBLISHERS, self.publish_sync, task_ids, queue)
            await asyncio.wait_for(sending, self.timeout)

    def publish_sync(self, task_ids: list[str], queue: str = DURABLE_QUEUE) -> None:
        with self.app.producer_or_acquire() as producer:
            for task_id in task_ids:
                self.app.send_task(
                    RUN_TASK, args=[task_id], queue=queue, producer=producer,
                    retry=True, retry_policy=RETRY_POLICY,
                )
