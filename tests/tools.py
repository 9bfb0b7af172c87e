"""Machine tools some tests need (Chromium, spin, RabbitMQ). Where one is missing the test says
what to install and is skipped; under CI (which installs or runs them all) a missing tool is a
broken setup, and the test fails instead of passing silently."""

from __future__ import annotations

import os
import shutil

import pytest


def require(present: bool, what: str, how: str) -> None:
    if present:
        return
    message = f"{what} is not installed here ({how})"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def require_rabbitmq() -> None:
    require(
        shutil.which("rabbitmqctl") is not None,
        "RabbitMQ (rabbitmqctl)",
        "apt-get install rabbitmq-server: these tests make a vhost of their own on 127.0.0.1:5672",
    )
