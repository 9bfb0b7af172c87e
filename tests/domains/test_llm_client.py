"""The chat-completions client against a real HTTP endpoint that fails the ways servers do: 429
with Retry-After, 503, malformed replies, refusals, a closed port. What is transient comes back as
a RetryableError after the client's own bounded retries; what is not fails at once, with the
endpoint's message on one line."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from domains.http_answers import retry_after, server_message
from domains.llm_client import (
    LLMBadOutput,
    LLMClient,
    LLMNotConfigured,
    LLMRefused,
    LLMSettings,
    LLMUnavailable,
    client_from_settings,
    first_json_object,
)
from tasks_core.retry import RetryableError
from tests.llm_endpoint import Reply, ScriptedEndpoint, completion


class Answer(BaseModel):
    answer: str


def _client(url: str, **overrides: Any) -> LLMClient:
    values: dict[str, Any] = {
        "url": url,
        "model": "test-model",
        "api_key": "sekrit",
        "retry_backoff_seconds": 0.05,
    }
    return LLMClient(LLMSettings(**(values | overrides)))


def test_transient_failures_are_retried_honouring_retry_after_and_a_malformed_reply_is_asked_again() -> None:
    script = [
        Reply(429, {"error": {"message": "slow down"}}, {"Retry-After": "1"}),
        Reply(503, "overloaded"),
        completion("Sure! Here it is: {answer: 'no quotes'"),
        completion('Here you are:\n```json\n{"answer": "forty-two", "note": {"x": 1}}\n```\nAnything else?'),
    ]
    with ScriptedEndpoint(script).running() as server:
        client = _client(server.url)
        assert client.chat_json("What is the answer?", Answer) == Answer(answer="forty-two")
    first, second, third, fourth = server.seen
    assert second.at - first.at >= 1.0  # the 429's Retry-After, not the 0.05 s backoff
    assert third.at - second.at < 1.0
    for seen in server.seen:
        assert seen.headers["authorization"] == "Bearer sekrit"
        assert seen.body["model"] == "test-model" and seen.body["temperature"] == 0.0
        assert seen.body["response_format"] == {"type": "json_object"}
        assert seen.body["stream"] is False
    assert [m["role"] for m in third.body["messages"]] == ["user"]
    # The unusable reply is shown back to the model with why.
    assert [m["role"] for m in fourth.body["messages"]] == ["user", "assistant", "user"]
    assert fourth.body["messages"][1]["content"] == "Sure! Here it is: {answer: 'no quotes'"
    assert "no JSON object" in fourth.body["messages"][2]["content"]


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (Reply(401, {"error": {"message": "Invalid API key\n   provided.", "type": "auth"}}),
         "answered 401 (DTASK_LLM_API_KEY): Invalid API key provided."),
        (Reply(404, {"detail": "The model `nope` does not exist"}),
         "answered 404 (DTASK_LLM_URL, DTASK_LLM_MODEL): The model `nope` does not exist"),
        (Reply(400, "context\nwindow exceeded"), "answered 400: context window exceeded"),
    ],
)  # fmt: skip
def test_a_refusal_fails_at_once_with_the_endpoint_message_on_one_line(reply: Reply, expected: str) -> None:
    with ScriptedEndpoint([reply]).running() as server, pytest.raises(LLMRefused) as caught:
        _client(server.url).chat_json("q", Answer)
    assert len(server.seen) == 1
    message = str(caught.value)
    assert message.endswith(expected) and "\n" not in message
    assert not isinstance(caught.value, RetryableError)


def test_a_server_that_stays_down_gives_a_retryable_error_after_the_tries() -> None:
    with (
        ScriptedEndpoint(
            [Reply(503, {"error": {"message": "loading model"}}, {"Retry-After": "0"})]
        ).running() as server,
        pytest.raises(LLMUnavailable) as caught,
    ):
        _client(server.url, max_tries=3).chat_json("q", Answer)
    assert len(server.seen) == 3
    error = caught.value
    assert isinstance(error, RetryableError) and error.code == "llm_unavailable" and error.delay == 0
    assert "answered 503: loading model (after 3 tries" in str(error)


def test_a_wait_longer_than_the_budget_is_left_to_the_tasks_retry() -> None:
    with ScriptedEndpoint([Reply(429, "busy", {"Retry-After": "30"})]).running() as server:
        started = time.monotonic()
        with pytest.raises(LLMUnavailable) as caught:
            _client(server.url, retry_budget_seconds=5).chat_json("q", Answer)
    assert time.monotonic() - started < 2 and len(server.seen) == 1
    assert caught.value.delay == 30  # the task waits what the server asked


def test_a_closed_port_is_transient() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(LLMUnavailable, match=f"cannot reach http://127.0.0.1:{port}/v1/chat/completions"):
        _client(f"http://127.0.0.1:{port}/v1", max_tries=2).chat_json("q", Answer)


def test_a_timeout_is_transient() -> None:
    with (
        ScriptedEndpoint([Reply(delay=1.0, body="late")]).running() as server,
        pytest.raises(LLMUnavailable, match=r"did not answer within 0.2 s \(DTASK_LLM_TIMEOUT_SECONDS\)"),
    ):
        _client(server.url, timeout_seconds=0.2, max_tries=1).chat_json("q", Answer)


def test_replies_that_never_parse_fail_for_good_after_the_json_attempts() -> None:
    replies = [completion("I cannot answer in JSON."), completion('{"answer": 7}', finish_reason="length")]
    with ScriptedEndpoint(replies).running() as server, pytest.raises(LLMBadOutput) as caught:
        _client(server.url, json_attempts=3).chat_json("q", Answer)
    assert len(server.seen) == 3
    assert not isinstance(caught.value, RetryableError)
    message = str(caught.value)
    assert "no valid JSON object in 3 replies (DTASK_LLM_JSON_ATTEMPTS)" in message
    assert "answer: Input should be a valid string (the reply was cut at DTASK_LLM_MAX_TOKENS)" in message


@pytest.mark.parametrize(
    "reply",
    [Reply(200, "<html>not json</html>"), Reply(200, {"choices": []}), completion(None)],
)
def test_a_200_that_is_no_completion_is_bad_output(reply: Reply) -> None:
    with ScriptedEndpoint([reply]).running() as server, pytest.raises(LLMBadOutput):
        _client(server.url, json_attempts=1).chat_json("q", Answer)


def test_a_server_refusing_json_mode_is_asked_without_it_from_then_on() -> None:
    script = [
        Reply(400, {"error": {"message": "'response_format' of type 'json_object' is not supported"}}),
        completion('{"answer": "a"}'),
    ]
    with ScriptedEndpoint(script).running() as server:
        client = _client(server.url)
        assert client.chat_json("q", Answer).answer == "a"
        assert client.chat_json("q", Answer).answer == "a"
    assert ["response_format" in s.body for s in server.seen] == [True, False, False]


def test_json_mode_off_sends_no_response_format_and_a_seed_is_sent() -> None:
    with ScriptedEndpoint([completion('{"answer": "a"}')]).running() as server:
        _client(server.url, json_mode="off", seed=11, api_key="").chat_json("q", Answer)
    [seen] = server.seen
    assert "response_format" not in seen.body and seen.body["seed"] == 11
    assert "authorization" not in seen.headers


def test_requests_in_flight_are_bounded_per_process() -> None:
    with ScriptedEndpoint(
        lambda seen: Reply(**vars(completion('{"answer": "a"}')) | {"delay": 0.3})
    ).running() as server:
        # Two clients of the same server share its bound.
        clients = [_client(server.url, concurrency=2), _client(server.url, concurrency=2)]
        with ThreadPoolExecutor(max_workers=6) as pool:
            results = list(pool.map(lambda i: clients[i % 2].chat_json("q", Answer), range(6)))
    assert [r.answer for r in results] == ["a"] * 6
    assert server.most_in_flight == 2


def test_missing_or_malformed_settings_are_refused_naming_the_variable() -> None:
    with pytest.raises(LLMNotConfigured, match="DTASK_LLM_URL is not set"):
        LLMClient(LLMSettings(url="", model="m"))
    with pytest.raises(LLMNotConfigured, match="DTASK_LLM_MODEL is not set"):
        LLMClient(LLMSettings(url="http://127.0.0.1:1/v1", model=""))
    with pytest.raises(LLMNotConfigured, match="not an http"):
        LLMClient(LLMSettings(url="127.0.0.1:1/v1", model="m"))


def test_the_process_reuses_one_client_per_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTASK_LLM_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("DTASK_LLM_MODEL", "m1")
    first = client_from_settings()
    assert client_from_settings() is first
    monkeypatch.setenv("DTASK_LLM_MODEL", "m2")
    assert client_from_settings() is not first and client_from_settings().model == "m2"


def test_the_first_json_object_is_found_whatever_surrounds_it() -> None:
    assert first_json_object('{"a": 1}') == {"a": 1}
    assert first_json_object('I think {not json} but then {"a": {"b": [1, "}"]}} and {"c": 2}') == {
        "a": {"b": [1, "}"]}
    }
    assert first_json_object('```json\n{"a": "x"}\n```') == {"a": "x"}
    for content in ("", "[1, 2]", "{'a': 1}", "no braces"):
        with pytest.raises(ValueError, match="no JSON object"):
            first_json_object(content)


def test_retry_after_reads_seconds_and_http_dates() -> None:
    def response(value: str) -> httpx.Response:
        return httpx.Response(429, headers={"Retry-After": value})

    assert retry_after(response("7")) == 7.0
    assert retry_after(response("Wed, 21 Oct 2015 07:28:10 GMT"), now=lambda: 1445412480.0) == 10.0
    assert retry_after(response("Wed, 21 Oct 2015 07:28:00 GMT"), now=lambda: 1445412490.0) == 0.0
    assert retry_after(response("soon")) is None
    assert retry_after(httpx.Response(429)) is None


def test_endpoint_messages_come_from_the_usual_error_shapes() -> None:
    assert server_message(httpx.Response(400, json={"error": {"message": "bad\nthing"}})) == "bad thing"
    assert server_message(httpx.Response(400, json={"error": "flat"})) == "flat"
    assert server_message(httpx.Response(422, json={"detail": [{"msg": "x"}]})) == '[{"msg": "x"}]'
    assert server_message(httpx.Response(400, text="x" * 1000)).endswith("\u2026")
    assert len(server_message(httpx.Response(400, text="x" * 1000))) == 300


def test_the_bound_is_a_real_semaphore_across_threads() -> None:
    # Sanity of the process bound itself, without a server: two holders, the third waits.
    from domains.llm_client import _slots

    slots = _slots("http://bound-test", 2)
    assert slots is _slots("http://bound-test", 2)
    slots.acquire()
    slots.acquire()
    third = threading.Thread(target=lambda: (slots.acquire(), slots.release()))
    third.start()
    third.join(0.2)
    assert third.is_alive()
    slots.release()
    third.join(2)
    assert not third.is_alive()
    slots.release()
