"""Property-based fuzzing of the API against its own OpenAPI document (schemathesis).

The app runs in a real uvicorn server on a loopback port, on a real database and Redis. Bounded
in examples so it belongs in the default suite: no 5xx, no undocumented status, no response body
that violates the schema.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from app.main import create_app
from tasks_core.duties.readiness import READINESS_KEY
from tests.conftest import make_settings
from tests.live_api import serve

KEYS = "fuzz:fuzz-secret-012345678,other:other-secret-01234567"
HEADERS = {"Authorization": "Bearer fuzz-secret-012345678"}


@pytest.fixture(scope="module")
def live_api(knowledge_stores: dict[str, str]) -> Iterator[str]:
    # With real Milvus and S3 configured, the /knowledge routes are fuzzed too (not just their 503).
    with serve(create_app(settings=make_settings(api_keys=KEYS, diagnostics="all"))) as url:
        yield url


@pytest.fixture(scope="module")
def api_schema(live_api: str, broker_url: str) -> Any:
    # A fresh readiness fact, so /readyz answers 200 (its documented 503 is tested elsewhere).
    fact = {"worker": "fuzz", "written_at": time.time() + 600}
    redis.Redis.from_url(broker_url).set(READINESS_KEY, json.dumps(fact), px=600_000)
    return schemathesis.openapi.from_url(f"{live_api}/openapi.json")


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def test_api_conforms_to_its_schema(api_schema: Any) -> None:
    # Driven by hand rather than through schemathesis' pytest plugin, which does not support
    # this pytest version; same strategies, same checks.
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 8

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=30,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
            # Deterministic in CI; DTASK_FUZZ_RANDOM=1 explores new inputs on each run.
            derandomize=not os.environ.get("DTASK_FUZZ_RANDOM"),
        )
        def check(case: Any) -> None:
            case.call_and_validate(headers=HEADERS, checks=CHECKS)

        check()


# Inputs a review crafted by hand (each once gave a 500): kept as a fixed corpus beside the
# generated cases, against the same live server.
def _deep(depth: int) -> str:
    return '{"task_type": "diagnostics.noop", "payload": ' + '{"a": ' * depth + "1" + "}" * depth + "}"


CORPUS = [
    ("POST", "/tasks", _deep(400)),
    ("POST", "/tasks", _deep(5000)),
    ("POST", "/tasks", '{"task_type": "diagnostics.noop", "payload": {"x": "\\ud800"}}'),
    ("POST", "/tasks", '{"task_type": "diagnostics.noop", "dedupe_key": "\\ud800"}'),
    ("POST", "/tasks", '{"task_type": "diagnostics.noop", "\\udc00": "\\ud800"}'),
    ("POST", "/tasks/batch", '{"tasks": [' + _deep(400) + "]}"),
    (
        "GET",
        "/tasks?cursor=MDAwMS0wMS0wMVQwMDowMDowMCsyMzo1OXwwMDAwMDAwMC0wMDAwLTAwMDAtMDAwMC0wMDAwMDAwMDAwMDA",
        "",
    ),
]


@pytest.mark.parametrize(("method", "path", "raw"), CORPUS)
def test_crafted_corpus_gets_clear_4xx(live_api: str, method: str, path: str, raw: str) -> None:
    import httpx

    r = httpx.request(
        method,
        live_api + path,
        content=raw.encode() if raw else None,
        headers={**HEADERS, "content-type": "application/json"},
        timeout=10,
    )
    assert 400 <= r.status_code < 500 or (path == "/tasks/batch" and r.json()["accepted"] == 0), r.text
    r.json()
