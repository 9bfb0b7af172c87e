"""Schedules as users give them: checked once, at creation, exactly as a submission would be.

A schedule's payload is validated against its task type's schema by ``submission.validate`` (the
same refusals, the same diagnostics policy for the key that creates it); the rule by
``schedule_rules``. Refusals are ``InvalidTask`` (field and message), like a submission's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from tasks_core.registry import Registry
from tasks_core.schedule_rules import BadRule, Rule
from tasks_core.settings import Settings
from tasks_core.store.schedules import NewSchedule
from tasks_core.submission import InvalidTask, TaskIntent, validate

# A name travels in URLs and shell commands: letters, digits, dot, dash and underscore.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
NAME_RULE = "1-100 letters, digits, '.', '-' or '_', starting with a letter or digit"


@dataclass(frozen=True)
class ScheduleIntent:
    name: Any
    task_type: Any
    payload: Any = field(default_factory=dict)
    cron: Any = None
    every_seconds: Any = None
    timezone: Any = None
    priority: Any = 0


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidTask("name", f"must be {NAME_RULE}")
    return name


def validate_schedule(
    intent: ScheduleIntent, registry: Registry, settings: Settings, owner: str, *, admin: bool
) -> NewSchedule:
    """The stored form of ``intent``, or InvalidTask (nothing is stored)."""
    name = check_name(intent.name)
    task = validate(
        TaskIntent(intent.task_type, intent.payload, priority=intent.priority),
        registry,
        settings,
        owner,
        admin=admin,
        public=True,
    )
    try:
        rule = Rule.checked(intent.cron, intent.every_seconds, intent.timezone)
    except BadRule as exc:
        raise InvalidTask(exc.field, exc.message) from None
    return NewSchedule(name, owner, task.task_type, task.payload, rule, task.priority)
