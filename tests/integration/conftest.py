"""Fixtures the API's integration tests share: services on the test database with three keys (alice,
bob, an admin root) and an in-process client of the app."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from app.main import create_app
from tasks_core.services import build_services
from tests.conftest import make_settings

KEYS = "alice:alice-secret-0123456,bob:bob-secret-01234567,root:root-secret-0123456:admin"


@pytest.fixture
async def svc(clean_db: None) -> AsyncIterator[Any]:
    services = build_services(
        # Every key may submit the diagnostics types here; their default policy is tested apart.
        make_settings(api_keys=KEYS, max_payload_bytes=2048, max_request_bytes=200_000, diagnostics="all"),
        pool_size=5,
    )
    yield services
    await services.close()


@pytest.fixture
async def client(svc: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(services=svc)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c
