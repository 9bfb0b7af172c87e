"""The static task registry: task_type -> handler module path, version, hooks and limits.

Handlers and hooks are named by ``"module:attribute"`` strings and imported only when a task of
that type runs or converges, so the API and beat never import domain code they do not need.
``tasks_core`` never imports a domain by name: the spec modules come from each domain's declaration
(``tasks_core.domain``), itself named by a string.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncConnection

from tasks_core.domain import load_domains
from tasks_core.model import LEGACY_VERSION
from tasks_core.retry import RetryableError

if TYPE_CHECKING:
    from tasks_core.worker.context import TaskContext

# Derived from the domains' declarations (tasks_core.domain.DOMAINS), never listed here: each
# module defines SPECS, a sequence of TaskSpec (and DUTIES if the domain has periodic upkeep).
DOMAIN_SPEC_MODULES: tuple[str, ...] = tuple(m for d in load_domains() for m in d.tasks)

# Command groups of domains, mounted under `dtask` by name ("kb" -> `dtask kb ...`), imported by path.
DOMAIN_CLIS: tuple[tuple[str, str], ...] = tuple(d.cli for d in load_domains() if d.cli is not None)

HookKind = Literal["success", "failure"]
Handler = Callable[["TaskContext"], Awaitable[Any]]


class Hook(Protocol):
    """Runs inside the terminal transaction; converges the domain rows this task still owns."""

    async def __call__(self, conn: AsyncConnection, task: Mapping[str, Any], status: str) -> None: ...


@dataclass(frozen=True)
class TaskSpec:
    task_type: str
    handler: str
    version: int = 1
    on_success: str | None = None
    on_failure: str | None = None
    timeout_seconds: float | None = None
    # Only handlers whose effects are idempotent and fenced may declare this: they are retried
    # (with backoff) after a lost lease or a worker shutdown, up to max_attempts in all.
    retry_safe: bool = False
    max_attempts: int = 1
    # Exceptions that mean "try again later" for this type (a store outage, a rate limit): raised
    # by the handler, they send a retry-safe task back to pending with backoff instead of failing
    # it, like tasks_core.retry.RetryableError does for every retry-safe type.
    retry_on: tuple[type[BaseException], ...] = ()
    # Optional per-type cap on running tasks, under the global capacity.
    concurrency: int | None = None
    # The payload's pydantic model: submissions are checked against it (422 with the field errors,
    # before anything is stored) and GET /task-types publishes its JSON Schema. None: any object.
    payload: type[BaseModel] | None = None
    # Built-in smoke-test types: who may submit them is DTASK_DIAGNOSTICS (admin, all, off).
    diagnostic: bool = False
    # Created only by its domain's own code, in the transaction that makes the rows its payload
    # names (a file, a dataset): POST /tasks, /tasks/batch and `dtask submit` refuse it, so no key
    # can aim one at rows it does not own or spend slots on bare ids.
    internal: bool = False
    # The broker queue its task ids travel on. Workers choose queues (`dtask worker --queues`), so
    # CPU-heavy types (say "durable-cpu") go to prefork workers and I/O-bound ones stay on
    # "durable", served by the dense mode (`--pool threads`). Capacity stays cluster-wide.
    queue: str = "durable"

    def __post_init__(self) -> None:
        if self.version <= LEGACY_VERSION:
            raise ValueError(f"{self.task_type}: handler version must be >= 1")
        if self.timeout_seconds is not None and not (
            math.isfinite(self.timeout_seconds) and self.timeout_seconds > 0
        ):
            raise ValueError(f"{self.task_type}: timeout must be positive and finite")
        if self.max_attempts < 1 or (self.max_attempts > 1 and not self.retry_safe):
            raise ValueError(f"{self.task_type}: only retry-safe handlers get more than one attempt")
        if self.retry_on and not self.retry_safe:
            raise ValueError(f"{self.task_type}: only retry-safe handlers may declare retry_on")

    def retries(self, exc: BaseException) -> bool:
        """Whether ``exc`` raised by this type's handler is transient: worth another attempt."""
        return self.retry_safe and isinstance(exc, (RetryableError, *self.retry_on))


@dataclass(frozen=True)
class DutySpec:
    """A domain's periodic upkeep (a verifier, a sweeper): beat schedules it every
    ``getattr(settings, every)`` seconds (unset: off), and a worker runs ``function(services)`` on
    the duties queue, like the runtime's own duties. It must be safe to run twice at once."""

    name: str
    function: str
    every: str


def import_path(path: str) -> Any:
    module, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"{path!r} is not 'module:attribute'")
    return getattr(importlib.import_module(module), attr)


class Registry:
    def __init__(self, specs: Iterable[TaskSpec], duties: Iterable[DutySpec] = ()) -> None:
        self._specs: dict[str, TaskSpec] = {}
        for spec in specs:
            if spec.task_type in self._specs:
                raise ValueError(f"task type {spec.task_type!r} registered twice")
            self._specs[spec.task_type] = spec
        self._duties: dict[str, DutySpec] = {}
        for duty in duties:
            if duty.name in self._duties:
                raise ValueError(f"duty {duty.name!r} registered twice")
            self._duties[duty.name] = duty
        self._imported: dict[str, Any] = {}

    @classmethod
    def from_modules(cls, modules: Iterable[str]) -> Registry:
        """Each module's SPECS, and its DUTIES if it has any."""
        specs: list[TaskSpec] = []
        duties: list[DutySpec] = []
        for name in modules:
            module = importlib.import_module(name)
            specs.extend(module.SPECS)
            duties.extend(getattr(module, "DUTIES", ()))
        return cls(specs, duties)

    def duties(self) -> list[DutySpec]:
        return list(self._duties.values())

    def duty(self, name: str) -> Callable[[Any], Coroutine[Any, Any, Any]] | None:
        """The function of the duty named ``name`` (imported now), or None for an unknown name."""
        spec = self._duties.get(name)
        fn: Callable[[Any], Coroutine[Any, Any, Any]] | None = None
        if spec is not None:
            fn = self._load(spec.function)
        return fn

    def __contains__(self, task_type: object) -> bool:
        return task_type in self._specs

    def get(self, task_type: str) -> TaskSpec | None:
        return self._specs.get(task_type)

    def specs(self) -> list[TaskSpec]:
        return list(self._specs.values())

    def queue_of(self, task_type: str) -> str:
        spec = self._specs.get(task_type)
        return spec.queue if spec is not None else "durable"

    def runnable(self, task_type: str, version: int) -> TaskSpec | None:
        """The spec that may run a row of this type and version (only the current version runs)."""
        spec = self._specs.get(task_type)
        return spec if spec is not None and spec.version == version else None

    def _load(self, path: str) -> Any:
        if path not in self._imported:
            self._imported[path] = import_path(path)
        return self._imported[path]

    def handler(self, spec: TaskSpec) -> Handler:
        fn: Handler = self._load(spec.handler)
        return fn

    def loaded_handler(self, spec: TaskSpec) -> Handler | None:
        """The handler if its module is imported already (no import here)."""
        fn: Handler | None = self._imported.get(spec.handler)
        return fn

    def hook_for(self, task_type: str, version: int, kind: HookKind) -> Hook | None:
        """The hook that converges a row of this type and version.

        The current version uses its own hooks; legacy rows (version 0, from the pre-durable
        release) use the current type's failure hook; any other version has none (fail closed).
        """
        spec = self._specs.get(task_type)
        if spec is None:
            return None
        if version == spec.version or (version == LEGACY_VERSION and kind == "failure"):
            path = spec.on_success if kind == "success" else spec.on_failure
            hook: Hook | None = None if path is None else self._load(path)
            return hook
        return None


def default_registry(extra_modules: Iterable[str] = ()) -> Registry:
    return Registry.from_modules([*DOMAIN_SPEC_MODULES, *extra_modules])
