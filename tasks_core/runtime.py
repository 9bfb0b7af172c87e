"""Claim a task and run its handler under a heartbeat, a timeout, cancel and shutdown.

One ``run_task`` per message. The message only carries an id: the claim in PostgreSQL decides
whether anything runs (a duplicate or stale message is dropped), and every write after it is
fenced by the attempt token and the lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, cast

from tasks_core import logs, metrics
from tasks_core.context import TaskCancelled, TaskContext
from tasks_core.model import Status
from tasks_core.registry import TaskSpec
from tasks_core.relay import relay
from tasks_core.repository import Claim, OwnershipLost
from tasks_core.services import Services

log = logging.getLogger(__name__)


class ShutdownSignal:
    """Set once when the worker process is asked to stop; running handlers then get a grace period."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def set(self) -> None:
        self.event.set()


@dataclass
class RunOutcome:
    claimed: bool
    status: str  # terminal status, "pending" (retry), "lost", or the claim refusal reason


def parse_task_id(raw: object) -> uuid.UUID | None:
    if not isinstance(raw, str):
        return None
    try:
        return uuid.UUID(raw)
    except ValueError:
        return None


async def run_task(services: Services, raw_id: object, shutdown: ShutdownSignal | None = None) -> RunOutcome:
    task_id = parse_task_id(raw_id)
    if task_id is None:
        log.warning("dropping malformed task message %s", logs.short(raw_id))
        return RunOutcome(False, "malformed_message")
    if shutdown is not None and shutdown.event.is_set():
        # A message handed to this child just as the worker began its warm shutdown: claiming it
        # now would only run it for the grace period and then fail it (worker_shutdown) or burn one
        # of its retries. Leave the row pending and marked as having no message in flight, so the
        # relay or the publisher sends the id again to a worker that is staying.
        log.info("task %s not claimed: this worker is shutting down", task_id)
        await services.repo.message_dropped(task_id)
        return RunOutcome(False, "worker_shutting_down")
    s = services.settings
    claim = await services.repo.claim(
        task_id,
        services.registry,
        capacity=s.capacity,
        lease_seconds=s.lease_seconds,
        worker=services.worker_name,
        lock_wait_seconds=min(2.0, s.heartbeat_seconds),
        owner_max_running=s.owner_max_running,
    )
    if isinstance(claim, str):
        log.info("task %s not claimed: %s", task_id, claim)
        metrics.CLAIM_REFUSED.labels(reason=claim.split(":")[0]).inc()
        if claim in ("capacity_full", "capacity_busy"):
            # The refusal marked the task for re-sending, but a slot may have freed (and its relay
            # run) before that commit was visible: relay once more, so no wake-up is lost.
            await _relay_quietly(services, task_id)
        return RunOutcome(False, claim)
    metrics.CLAIMS.inc()
    spec = services.registry.runnable(claim.task["task_type"], claim.task["handler_version"])
    assert spec is not None  # the claim checked it
    status = await Execution(services, claim, spec, shutdown or ShutdownSignal()).run()
    if status != "lost":
        # A slot just freed (or a task went back to pending): hand it on without waiting for beat.
        await _relay_quietly(services, task_id)
    return RunOutcome(True, status)


async def _relay_quietly(services: Services, task_id: uuid.UUID) -> None:
    try:
        await relay(services)
    except Exception:
        log.exception("relay after task %s failed; the publisher will catch up", task_id)


class Execution:
    def __init__(self, services: Services, claim: Claim, spec: TaskSpec, shutdown: ShutdownSignal) -> None:
        self.services = services
        self.repo = services.repo
        self.claim = claim
        self.spec = spec
        self.shutdown = shutdown
        self.task_id: uuid.UUID = claim.task["id"]
        self.token = claim.token
        self.ctx = TaskContext(
            services.repo,
            dict(claim.task),
            claim.token,
            claim.attempt,
            progress_delta=services.settings.progress_delta,
        )
        self.stop_reason: str | None = None
        self._handler_task: asyncio.Task[Any] | None = None

    def stop(self, reason: str) -> None:
        """First reason wins; the handler is cancelled so its finally blocks clean up."""
        if self.stop_reason is None:
            self.stop_reason = reason
            if reason == "cancelled":
                self.ctx.request_cancel()
            if self._handler_task is not None:
                self._handler_task.cancel()

    async def run(self) -> str:
        handler = self.services.registry.handler(self.spec)
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        self._handler_task = asyncio.create_task(
            cast(Coroutine[Any, Any, Any], handler(self.ctx)), name=f"handler-{self.task_id}"
        )
        guards = [
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
            asyncio.create_task(self._watch_shutdown(), name="shutdown-watch"),
        ]
        # Local monotonic time is fine for the timeout: it measures this attempt's own run time.
        timer = loop.call_later(float(self.claim.task["timeout_seconds"]), self.stop, "timeout")
        try:
            await asyncio.wait({self._handler_task})
        finally:
            timer.cancel()
            for guard in guards:
                guard.cancel()
            await asyncio.gather(*guards, return_exceptions=True)
        metrics.HANDLER_SECONDS.labels(task_type=self.spec.task_type).observe(time.monotonic() - started)
        return await self._finalize(self._handler_task)

    async def _heartbeat(self) -> None:
        s = self.services.settings
        last_renewed = time.monotonic()
        while True:
            await asyncio.sleep(s.heartbeat_seconds)
            try:
                beat = await self.repo.heartbeat(self.task_id, self.token, s.lease_seconds)
            except Exception:
                log.warning("heartbeat of %s failed; retrying", self.task_id, exc_info=True)
                if time.monotonic() - last_renewed >= s.lease_seconds:
                    # We cannot have renewed in time: the lease is gone, writes would be refused.
                    self.stop("lost")
                    return
                continue
            if not beat.owned:
                metrics.FENCED_WRITES_REJECTED.labels(write="heartbeat").inc()
                self.stop("lost")
                return
            last_renewed = time.monotonic()
            if beat.cancel_requested:
                self.stop("cancelled")
                return

    async def _watch_shutdown(self) -> None:
        await self.shutdown.event.wait()
        await asyncio.sleep(self.services.settings.shutdown_grace_seconds)
        self.stop("worker_shutdown")

    async def _finalize(self, done: asyncio.Task[Any]) -> str:
        reason = self.stop_reason
        exc: BaseException | None = None if done.cancelled() else done.exception()
        if isinstance(exc, OwnershipLost):
            reason = "lost"
        elif isinstance(exc, TaskCancelled):
            reason = reason or "cancelled"
        if reason == "lost":
            return self._lost()
        if reason is None and exc is None:
            return await self._finish(Status.SUCCESS, result=done.result())
        if reason == "cancelled":
            return await self._finish(Status.CANCELLED, error=_err("cancelled", "cancelled on request"))
        if reason == "timeout":
            timeout = self.claim.task["timeout_seconds"]
            return await self._finish(
                Status.FAILED, error=_err("timeout", f"exceeded its {timeout:g} s timeout")
            )
        if reason == "worker_shutdown":
            return await self._shutdown_outcome()
        assert exc is not None
        log.warning("task %s handler raised", self.task_id, exc_info=exc)
        return await self._finish(Status.FAILED, error=_err("handler_error", f"{type(exc).__name__}: {exc}"))

    async def _shutdown_outcome(self) -> str:
        # A hand-back that races a cancel request leaves a pending row with cancel intent; the
        # reconciler ends it `cancelled` (with its hook) on its next run.
        if self.spec.retry_safe and self.claim.attempt < self.spec.max_attempts:
            if await self.repo.release(self.task_id, self.token, outcome="worker_shutdown", delay=0):
                return Status.PENDING.value
            metrics.FENCED_WRITES_REJECTED.labels(write="release").inc()
            return "lost"
        return await self._finish(
            Status.FAILED, error=_err("worker_shutdown", "the worker stopped before the task finished")
        )

    async def _finish(
        self, status: Status, *, result: Any = None, error: dict[str, str] | None = None
    ) -> str:
        """The terminal transaction with its hook. If that fails (a hook raised, the result is not
        JSON), the task still ends: failed with the failure hook, and if even that hook raises,
        failed without it, so a broken hook can never leave a task running."""
        try:
            return await self._terminal(status, result, error, hooks=True)
        except OwnershipLost:
            return self._lost()
        except Exception as exc:
            log.exception("terminal transaction of %s failed", self.task_id)
            code = "bad_result" if isinstance(exc, TypeError) else "hook_failed"
            failure = _err(code, f"{type(exc).__name__}: {exc}")
        try:
            return await self._terminal(Status.FAILED, None, failure, hooks=True)
        except OwnershipLost:
            return self._lost()
        except Exception:
            log.exception("failure hook of %s raised; ending the task without it", self.task_id)
        try:
            return await self._terminal(Status.FAILED, None, failure, hooks=False)
        except OwnershipLost:
            return self._lost()

    async def _terminal(
        self, status: Status, result: Any, error: dict[str, str] | None, *, hooks: bool
    ) -> str:
        registry = self.services.registry if hooks else None
        try:
            final = await self.repo.finish(
                self.task_id, self.token, registry, status=status, result=result, error=error
            )
        except OwnershipLost:
            metrics.FENCED_WRITES_REJECTED.labels(write="finish").inc()
            raise
        return final.value

    def _lost(self) -> str:
        metrics.LEASE_LOST.inc()
        log.warning("task %s: lease lost before its terminal write; nothing written", self.task_id)
        return "lost"


def _err(code: str, message: str) -> dict[str, str]:
    return {"code": code, "message": message[:2000]}
