"""Claim a task and run its handler under a heartbeat, a timeout, cancel and shutdown.

One ``run_task`` per message. The message only carries an id: the claim in PostgreSQL decides
whether anything runs (a duplicate or stale message is dropped), and every write after it is
fenced by the attempt token and the lease.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import traceback
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, cast

from tasks_core import logs, metrics
from tasks_core.duties.relay import publish_due, relay, relay_options
from tasks_core.model import Status
from tasks_core.registry import TaskSpec
from tasks_core.retry import RetryableError, backoff
from tasks_core.services import Services
from tasks_core.store.outcomes import Claim, HookFailed, OwnershipLost, Refused
from tasks_core.worker.context import TaskCancelled, TaskContext
from tasks_core.worker.lease import DatabaseUnavailable, retry_transient

log = logging.getLogger(__name__)


class ShutdownSignal:
    """Set once when the worker process is asked to stop; running handlers then get a grace period.

    Runs call ``on_set`` instead of keeping a task waiting on the event: most attempts end long
    before any shutdown, and a waiting task per attempt was CPU spent on nothing."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self._callbacks: list[Callable[[], None]] = []

    def set(self) -> None:
        if self.event.is_set():
            return
        self.event.set()
        for callback in self._callbacks[:]:
            callback()

    def on_set(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` once the signal is set (now, if it already is); returns the undo."""
        if self.event.is_set():
            callback()
            return lambda: None
        self._callbacks.append(callback)
        return lambda: self._callbacks.remove(callback)


# Handler tasks are named "<prefix><task type>:<task id>": the loop watchdog names a blocking one.
HANDLER_TASK_PREFIX = "dtask-handler:"
# How long a claim is retried through a database blink before its message is dropped.
CLAIM_RETRY_SECONDS = 2.0


class HandlerUnresponsive(Exception):
    """The handler ignored cancellation and still runs in this process's event loop: the process
    must be recycled (its terminal state, ``args[0]``, has been written where it could be)."""


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
    """Run the task a message names; then, up to DTASK_WORKER_RUN_NEXT times, the task its terminal
    write picked for the slot it freed (each claimed afresh, exactly as if its message had come).
    The outcome is the named task's."""
    task_id = parse_task_id(raw_id)
    if task_id is None:
        log.warning("dropping malformed task message %s", logs.short(raw_id))
        return RunOutcome(False, "malformed_message")
    shutdown = shutdown or ShutdownSignal()
    left = services.settings.worker_run_next
    outcome, following = await _run_one(services, task_id, shutdown, take_next=left > 0)
    while following is not None:
        left -= 1
        metrics.RUN_NEXT.inc()
        _, following = await _run_one(services, following, shutdown, take_next=left > 0)
    return outcome


async def _run_one(
    services: Services, task_id: uuid.UUID, shutdown: ShutdownSignal, *, take_next: bool
) -> tuple[RunOutcome, uuid.UUID | None]:
    """Claim and run one task; with ``take_next``, also the id this process should run next itself."""
    if shutdown.event.is_set():
        # A message handed to this child just as the worker began its warm shutdown: claiming it
        # now would only run it for the grace period and then fail it (worker_shutdown) or burn one
        # of its retries. Leave the row pending and marked as having no message in flight, so the
        # relay or the publisher sends the id again to a worker that is staying.
        log.info("task %s not claimed: this worker is shutting down", task_id)
        await services.repo.message_dropped(task_id)
        return RunOutcome(False, "worker_shutting_down"), None
    s = services.settings
    lease = services.lease
    first = time.monotonic()

    async def take() -> Claim | Refused:
        return await services.repo.claim(
            task_id,
            services.registry,
            capacity=s.capacity,
            lease_seconds=lease.lease_seconds,
            worker=services.worker_name,
            lock_wait_seconds=lease.claim_lock_wait_seconds,
            owner_max_running=s.owner_running_limit,
        )

    try:
        # A broken pooled connection (a restarted server, a terminated backend) is replaced by the
        # retry. If the claim did commit before its answer was lost, the retry finds the task
        # running and the unseen attempt's lease lapses into the reconciler's hands.
        claim = await retry_transient(take, lambda: first + CLAIM_RETRY_SECONDS, f"claim of {task_id}")
    except DatabaseUnavailable as exc:
        # Nothing is lost: the row is still pending and the publisher re-sends it.
        log.warning("task %s not claimed: database unavailable (%s)", task_id, exc)
        metrics.CLAIM_REFUSED.labels(reason="database_unavailable").inc()
        return RunOutcome(False, "database_unavailable"), None
    if isinstance(claim, str):
        log.info("task %s not claimed: %s", task_id, claim)
        metrics.CLAIM_REFUSED.labels(reason=claim.reason).inc()
        if claim in ("capacity_full", "capacity_busy"):
            # The refusal marked the task for re-sending, but a slot may have freed (and its relay
            # run) before that commit was visible: relay once more, so no wake-up is lost.
            await _relay_quietly(services, task_id)
        return RunOutcome(False, claim), None
    metrics.CLAIMS.inc()
    spec = services.registry.runnable(claim.task["task_type"], claim.task["handler_version"])
    assert spec is not None  # the claim checked it
    execution = Execution(services, claim, spec, shutdown, claim_answered_at=time.monotonic())
    status = await execution.run()
    following = None
    if execution.relayed is not None:
        # The terminal write already picked what the freed slot takes next: keep one for this
        # process (stamped as sent, it is in flight to us), send the rest.
        due = execution.relayed
        if take_next and not execution.unresponsive and not shutdown.event.is_set():
            following, due = _keep_one(services, spec.task_type, due)
        await _publish_quietly(services, task_id, due)
    elif status != "lost":
        # A slot just freed (or a task went back to pending): hand it on without waiting for beat.
        await _relay_quietly(services, task_id)
    if execution.unresponsive:
        raise HandlerUnresponsive(status)
    return RunOutcome(True, status), following


def _keep_one(
    services: Services, task_type: str, due: list[tuple[uuid.UUID, str]]
) -> tuple[uuid.UUID | None, list[tuple[uuid.UUID, str]]]:
    """The first picked task on the queue this task came from (this worker consumes that queue; a
    type routed elsewhere must reach its own workers), and the rest."""
    queue = services.registry.queue_of(task_type)
    for i, (task_id, picked_type) in enumerate(due):
        if services.registry.queue_of(picked_type) == queue:
            return task_id, due[:i] + due[i + 1 :]
    return None, due


async def _relay_quietly(services: Services, task_id: uuid.UUID) -> None:
    try:
        await relay(services)
    except Exception:
        log.exception("relay after task %s failed; the publisher will catch up", task_id)


async def _publish_quietly(services: Services, task_id: uuid.UUID, due: list[tuple[uuid.UUID, str]]) -> None:
    # A failed publish is recorded on the rows (publish_due), which the relay or publisher re-send.
    try:
        await publish_due(services, due, by="relay")
    except Exception:
        log.exception("relay after task %s failed; the publisher will catch up", task_id)


class Execution:
    """One attempt: the handler, its heartbeat, timeout, cancel and shutdown, then the terminal write.

    The heartbeat keeps renewing the lease until the terminal write is done (a slow cleanup after
    cancel must not lose the lease), and every database call of the attempt rides out a blink while
    the lease may still be valid (``LeaseClock``).
    """

    def __init__(
        self,
        services: Services,
        claim: Claim,
        spec: TaskSpec,
        shutdown: ShutdownSignal,
        *,
        claim_answered_at: float | None = None,
    ) -> None:
        self.services = services
        self.repo = services.repo
        self.claim = claim
        self.spec = spec
        self.shutdown = shutdown
        self.task_id: uuid.UUID = claim.task["id"]
        self.token = claim.token
        self.policy = services.lease
        self.lease = self.policy.clock(renewed_at=claim_answered_at)
        self.ctx = TaskContext(
            services.repo,
            dict(claim.task),
            claim.token,
            claim.attempt,
            progress_delta=services.settings.progress_delta,
            lease=self.lease,
        )
        self.stop_reason: str | None = None
        # Resolved by stop(): what _wait_for_handler waits on beside the handler.
        self._stopped: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._handler_task: asyncio.Task[Any] | None = None
        # Started only when due (the first beat; a shutdown signal): most attempts end before either.
        self._beat_task: asyncio.Task[None] | None = None
        self._grace_timer: asyncio.TimerHandle | None = None
        # Set once the terminal write starts: the heartbeat then only keeps the lease alive, and a
        # refusal it sees is the terminal commit itself, not a lost lease.
        self._finishing = False
        # The handler ignored its cancellation for the whole grace period (it still runs).
        self.unresponsive = False
        # What the committed terminal write picked for the freed slot (None: no terminal write of
        # ours committed with a relay, so run_task relays separately).
        self.relayed: list[tuple[uuid.UUID, str]] | None = None

    def stop(self, reason: str) -> None:
        """First reason wins; the handler is cancelled so its finally blocks clean up."""
        if self.stop_reason is None:
            self.stop_reason = reason
            if not self._stopped.done():
                self._stopped.set_result(None)
            if reason == "cancelled":
                self.ctx.request_cancel()
            if self._handler_task is not None:
                self._handler_task.cancel()

    async def run(self) -> str:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        # The heartbeat task starts at the first beat, and the shutdown grace on the signal: most
        # attempts end before either (a task each per attempt cost 3-5 % of a no-op's CPU).
        beat_timer = loop.call_later(self.policy.heartbeat_seconds, self._start_heartbeat)
        unwatch = self.shutdown.on_set(self._start_grace)
        self._handler_task = asyncio.create_task(
            self._load_and_run(), name=f"{HANDLER_TASK_PREFIX}{self.spec.task_type}:{self.task_id}"
        )
        # Local monotonic time is fine for the timeout: it measures this attempt's own run time.
        timer = loop.call_later(float(self.claim.task["timeout_seconds"]), self.stop, "timeout")
        try:
            await self._wait_for_handler()
            metrics.HANDLER_SECONDS.labels(task_type=self.spec.task_type).observe(time.monotonic() - started)
            self._finishing = True
            return await self._finalize(self._handler_task)
        finally:
            unwatch()
            for handle in (timer, beat_timer, self._grace_timer):
                if handle is not None:
                    handle.cancel()
            if self._beat_task is not None:
                self._beat_task.cancel()
                await asyncio.gather(self._beat_task, return_exceptions=True)

    def _start_heartbeat(self) -> None:
        self._beat_task = asyncio.create_task(self._heartbeat(), name="heartbeat")

    def _start_grace(self) -> None:
        grace = self.services.settings.shutdown_grace_seconds
        # The attempt's own loop: the signal may be set from code not running in it.
        self._grace_timer = self._stopped.get_loop().call_later(grace, self.stop, "worker_shutdown")

    async def _load_and_run(self) -> Any:
        registry = self.services.registry
        handler = registry.loaded_handler(self.spec)
        if handler is None:
            # The first task of a type imports its module off the loop, with the heartbeat already
            # beating: a heavy import (numpy, a client library) must not cost the lease. A module
            # that fails to import fails the task like a handler that raises.
            handler = await asyncio.to_thread(registry.handler, self.spec)
        return await cast(Coroutine[Any, Any, Any], handler(self.ctx))

    async def _wait_for_handler(self) -> None:
        """Until the handler ends; once it has been told to stop, at most the cleanup grace more."""
        assert self._handler_task is not None
        await asyncio.wait({self._handler_task, self._stopped}, return_when=asyncio.FIRST_COMPLETED)
        if self._handler_task.done():
            return
        grace = self.services.settings.cleanup_grace_seconds
        done, _ = await asyncio.wait({self._handler_task}, timeout=grace)
        if not done:
            self.unresponsive = True
            log.error(
                "task %s (%s): the handler ignored its cancellation (%s) for %.0f s; ending the "
                "attempt without it",
                self.task_id, self.spec.task_type, self.stop_reason, grace,
            )

    async def _heartbeat(self) -> None:
        """Renew the lease every lease/3 and read cancel intent, until the terminal write is done;
        started at the first beat's time.

        Each renewal has a deadline below the interval; a failed one is retried at once with short
        backoff, and the attempt is given up only when the lease can no longer be valid.
        """
        policy = self.policy
        interval = policy.heartbeat_seconds
        delay = 0.0
        backoff = 0.1
        while True:
            if delay:
                await asyncio.sleep(delay)
            try:
                async with asyncio.timeout(policy.renewal_timeout_seconds):
                    beat = await self.repo.heartbeat(self.task_id, self.token, policy.lease_seconds)
            except Exception as exc:
                if self.lease.remaining() <= 0:
                    log.warning("task %s: no renewal reached the database within the lease", self.task_id)
                    self.stop("lost")
                    return
                log.warning("heartbeat of %s failed (%s); retrying", self.task_id, type(exc).__name__)
                delay, backoff = min(backoff, max(self.lease.remaining(), 0.01)), min(backoff * 2, 1.0)
                continue
            delay, backoff = interval, 0.1
            if not beat.owned:
                if not self._finishing:
                    metrics.FENCED_WRITES_REJECTED.labels(write="heartbeat").inc()
                    self.stop("lost")
                return
            self.lease.renewed(time.monotonic())
            if beat.cancel_requested and not self._finishing:
                self.stop("cancelled")  # and keep beating through the handler's cleanup

    async def _finalize(self, done: asyncio.Task[Any]) -> str:
        if self.unresponsive:
            if self.stop_reason == "lost":
                return self._lost()
            return await self._finish(
                Status.FAILED,
                error=_err(
                    "handler_unresponsive",
                    f"the handler ignored its cancellation ({self.stop_reason}) for "
                    f"{self.services.settings.cleanup_grace_seconds:g} s",
                ),
            )
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
        if self.spec.retries(exc):
            return await self._retry_outcome(exc)
        log.warning("task %s handler raised", self.task_id, exc_info=exc)
        code = "database_unavailable" if isinstance(exc, DatabaseUnavailable) else "handler_error"
        return await self._finish(Status.FAILED, error=_err(code, _short(exc)), detail=_detail(exc))

    async def _retry_outcome(self, exc: BaseException) -> str:
        """A transient failure: back to pending after a backoff (its slot freed meanwhile), or,
        with no attempt left, failed under the error's own code."""
        attempt, most = self.claim.attempt, self.spec.max_attempts
        code = exc.code if isinstance(exc, RetryableError) else "retryable"
        if attempt >= most:
            log.warning("task %s: attempt %d of %d failed; no attempt left", self.task_id, attempt, most)
            message = f"{_short(exc)} (attempt {attempt} of {most}; no attempt left)"
            return await self._finish(Status.FAILED, error=_err(code, message), detail=_detail(exc))
        settings = self.services.settings
        explicit = exc.delay if isinstance(exc, RetryableError) else None
        if explicit is None:
            delay = backoff(settings, attempt)
        else:
            delay = min(explicit, settings.retry_backoff_max_seconds)
        log.info(
            "task %s: attempt %d of %d failed (%s); retrying in %.1f s",
            self.task_id, attempt, most, _short(exc), delay,
        )  # fmt: skip
        why = f"attempt {attempt} of {most} failed ({code}: {_short(exc)}); retrying in {delay:.0f} s"
        return await self._hand_back("retry", delay, detail=_detail(exc), message=why[:2000])

    async def _shutdown_outcome(self) -> str:
        # A hand-back that races a cancel request leaves a pending row with cancel intent; the
        # reconciler ends it `cancelled` (with its hook) on its next run.
        if self.spec.retry_safe and self.claim.attempt < self.spec.max_attempts:
            return await self._hand_back("worker_shutdown", 0)
        return await self._finish(
            Status.FAILED, error=_err("worker_shutdown", "the worker stopped before the task finished")
        )

    async def _hand_back(
        self, outcome: str, delay: float, *, detail: str | None = None, message: str | None = None
    ) -> str:
        """Back to pending, claimable again after ``delay`` seconds; "lost" if no longer ours."""
        try:
            released = await retry_transient(
                lambda: self.repo.release(
                    self.task_id, self.token, outcome=outcome, delay=delay, detail=detail, message=message
                ),
                lambda: self.lease.deadline,
                f"hand-back of {self.task_id}",
            )
        except DatabaseUnavailable:
            return self._lost()
        if released:
            return Status.PENDING.value
        metrics.FENCED_WRITES_REJECTED.labels(write="release").inc()
        return "lost"

    async def _finish(
        self,
        status: Status,
        *,
        result: Any = None,
        error: dict[str, str] | None = None,
        detail: str | None = None,
    ) -> str:
        """The terminal transaction with its hook, retried through a database blink while the lease
        may hold. If the result is not JSON or the hook raises, the task still ends: failed with the
        failure hook, and if even that hook raises, failed without it, so a broken hook can never
        leave a task running."""
        if status == Status.SUCCESS:
            try:
                json.dumps(result, allow_nan=False)
            except (TypeError, ValueError) as exc:
                status, result = Status.FAILED, None
                error = _err("bad_result", f"the handler's result is not JSON: {_short(exc)}")
        try:
            return await self._terminal(status, result, error, hooks=True, detail=detail)
        except (OwnershipLost, DatabaseUnavailable) as exc:
            return self._gone(exc)
        except HookFailed as exc:
            log.error("task %s: %s", self.task_id, exc, exc_info=exc.__cause__)
            failure, detail = _err("hook_failed", str(exc)), _detail(exc.__cause__ or exc)
        if status == Status.SUCCESS:  # the success hook failed: the failure hook converges instead
            try:
                return await self._terminal(Status.FAILED, None, failure, hooks=True, detail=detail)
            except (OwnershipLost, DatabaseUnavailable) as exc:
                return self._gone(exc)
            except HookFailed as exc:
                log.error("task %s: %s too; ending the task without hooks", self.task_id, exc)
        try:
            return await self._terminal(Status.FAILED, None, failure, hooks=False, detail=detail)
        except (OwnershipLost, DatabaseUnavailable) as exc:
            return self._gone(exc)

    async def _terminal(
        self, status: Status, result: Any, error: dict[str, str] | None, *, hooks: bool, detail: str | None
    ) -> str:
        registry = self.services.registry if hooks else None
        handing_on = relay_options(self.services)
        try:
            final = await retry_transient(
                lambda: self.repo.finish_and_relay(
                    self.task_id, self.token, registry, status=status, result=result, error=error,
                    detail=detail, kind=(self.spec.task_type, self.spec.version), relay=handing_on,
                ),
                lambda: self.lease.deadline,
                f"terminal write of {self.task_id}",
            )
        except OwnershipLost:
            # A COMMIT whose answer was lost to a blink, then retried, is refused: the attempt row
            # says whether it was ours.
            ended = await self.repo.attempt_outcome(self.token)
            if ended is not None:
                return ended
            metrics.FENCED_WRITES_REJECTED.labels(write="finish").inc()
            raise
        self.relayed = final.relay
        return final.status.value

    def _gone(self, exc: Exception) -> str:
        if isinstance(exc, DatabaseUnavailable):
            log.error(
                "task %s: the database stayed unreachable until the lease ran out; the reconciler "
                "converges the task",
                self.task_id,
            )
        return self._lost()

    def _lost(self) -> str:
        metrics.LEASE_LOST.inc()
        log.warning("task %s: lease lost before its terminal write; nothing written", self.task_id)
        return "lost"


def _short(exc: BaseException) -> str:
    """What a task's owner reads: the exception's class and the first line of its message."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"[:300] if first else type(exc).__name__


def _detail(exc: BaseException) -> str:
    """What an operator reads in the attempt record: the whole exception, traceback included."""
    return "".join(traceback.format_exception(exc))[-8000:]


def _err(code: str, message: str) -> dict[str, str]:
    return {"code": code, "message": message[:2000]}
