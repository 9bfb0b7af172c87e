"""Typed payloads: each type's pydantic model checks submissions and publishes its JSON Schema."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from app.main import create_app
from tasks_core.registry import default_registry
from tasks_core.services import build_services
from tests.conftest import make_settings

KEYS = "alice:alice-secret-0123456,root:root-secret-0123456:admin"
ALICE = {"Authorization": "Bearer alice-secret-0123456"}
ROOT = {"Authorization": "Bearer root-secret-0123456"}


@pytest.fixture
async def client(clean_db: None) -> AsyncIterator[httpx.AsyncClient]:
    svc = build_services(make_settings(api_keys=KEYS), pool_size=2)
    app = create_app(services=svc)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        yield c
    await svc.close()


async def test_a_bad_payload_is_422_with_each_field_error(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/tasks",
        json={"task_type": "diagnostics.sleep", "payload": {"seconds": "abc", "secs": 1}},
        headers=ROOT,
    )
    assert r.status_code == 422
    locs = {tuple(e["loc"]) for e in r.json()["detail"]}
    assert locs == {("body", "payload", "seconds"), ("body", "payload", "secs")}
    assert (await client.get("/tasks", headers=ROOT)).json()["items"] == []


async def test_unknown_type_lists_the_types_this_key_may_submit(client: httpx.AsyncClient) -> None:
    r = await client.post("/tasks", json={"task_type": "nope"}, headers=ROOT)
    assert r.status_code == 422 and "diagnostics.sleep" in r.json()["detail"][0]["msg"]


async def test_task_types_publish_versions_timeouts_and_payload_schemas(client: httpx.AsyncClient) -> None:
    types = {t["task_type"]: t for t in (await client.get("/task-types", headers=ROOT)).json()}
    sleep = types["diagnostics.sleep"]
    assert sleep["version"] == 1 and sleep["retry_safe"] is False
    assert sleep["default_timeout_seconds"] == 6 * 3600
    schema = sleep["payload_schema"]
    assert schema["additionalProperties"] is False
    assert schema["properties"]["steps"]["maximum"] == 100_000
    assert types["diagnostics.sleep_retry_safe"]["retry_safe"] is True
    assert types["diagnostics.noop"]["payload_schema"] == {"type": "object"}
    assert (await client.get("/task-types")).status_code == 401


def test_every_built_in_type_but_the_echo_declares_a_payload_model() -> None:
    # noop returns whatever object it is given: the one type whose payload is free-form.
    untyped = {s.task_type for s in default_registry().specs() if s.payload is None}
    assert untyped == {"diagnostics.noop"}


def test_handlers_read_the_same_model_they_were_checked_against() -> None:
    from domains.diagnostics.payloads import SleepPayload

    assert SleepPayload.model_validate({}).steps == 1
    with pytest.raises(ValueError):
        SleepPayload.model_validate({"steps": 1.5})


async def test_task_types_in_openapi(client: Any) -> None:
    doc = (await client.get("/openapi.json")).json()
    assert "/task-types" in doc["paths"]
    assert "HTTPBearer" in doc["components"]["securitySchemes"]


INTERNAL = (
    "knowledge.ingest", "knowledge.reindex", "evaluation.generate_dataset", "evaluation.run", "graph.build"
)


@pytest.mark.parametrize("task_type", INTERNAL)
async def test_a_domains_own_types_cannot_be_submitted_directly(
    client: httpx.AsyncClient, task_type: str
) -> None:
    """They name rows of their domain (another tenant's file, say): only the domain's routes create
    them, with those rows. Every key, admin included, is refused, and nothing is stored."""
    payloads = {"knowledge.reindex": {"base_id": "0" * 32}, "graph.build": {"build_id": "0" * 32}}
    body = {"task_type": task_type, "payload": payloads.get(task_type, {"file_id": "0" * 32})}
    for key in (ALICE, ROOT):
        r = await client.post("/tasks", json=body, headers=key)
        assert r.status_code == 403, r.text
        assert "created by their domain's own routes" in r.text
        r = await client.post("/tasks/batch", json={"tasks": [body]}, headers=key)
        assert r.status_code == 202 and r.json()["results"][0]["error"]["code"] == "forbidden", r.text
    assert (await client.get("/tasks", headers=ROOT)).json()["items"] == []
    listed = {t["task_type"]: t for t in (await client.get("/task-types", headers=ROOT)).json()}
    assert listed[task_type]["internal"] is True
    assert listed["diagnostics.noop"]["internal"] is False
