"""celeryconfig declares exactly what celery_settings() computes for the process's settings."""

from __future__ import annotations

import celeryconfig
from tasks_core.celery_config import celery_settings
from tasks_core.settings import get_settings


def test_celeryconfig_names_every_setting_celery_settings_computes() -> None:
    computed = celery_settings(get_settings())
    declared = {name: getattr(celeryconfig, name) for name in computed if hasattr(celeryconfig, name)}
    assert set(declared) == set(computed)
    assert repr(declared) == repr(computed)  # kombu Queues compare by name only: compare their repr
