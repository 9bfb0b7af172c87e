"""The client every domain's language-model feature shares: OpenAI-compatible
``/v1/chat/completions`` (vLLM, Ollama, llama.cpp, TGI and hosted providers serve it), JSON out.

``chat_json`` sends one user message and returns the first JSON object of the reply, validated by a
pydantic model. Its failures come in two kinds, so a task can tell them apart:

- ``LLMUnavailable`` (a ``RetryableError``): the server could not answer now (408, 429, 5xx, no
  connection, a timeout) after the client's own retries, which back off exponentially with jitter,
  honour ``Retry-After`` and stop at a time budget. A retry-safe task goes back to pending; any other
  task fails with that one line.
- ``LLMRefused`` / ``LLMBadOutput``: another attempt would meet the same answer (400, 401, 403, 404, or
  a reply that is no valid JSON object after ``DTASK_LLM_JSON_ATTEMPTS`` tries); the task fails with
  the endpoint's own message on one line.

Requests in flight are bounded per process (``DTASK_LLM_CONCURRENCY``), across every thread and task.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from domains.http_answers import retry_after, server_message
from tasks_core.retry import RetryableError, jittered

log = logging.getLogger(__name__)

T = TypeVar("T", bound=BaseModel)

# Statuses another try may get past: a timeout, rate limiting, the server's own trouble.
RETRYABLE_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
# Which setting a refusal most likely points at.
_HINTS = {401: " (DTASK_LLM_API_KEY)", 403: " (DTASK_LLM_API_KEY)", 404: " (DTASK_LLM_URL, DTASK_LLM_MODEL)"}
# How much of an endpoint's message a task's error keeps.
MESSAGE_CHARS = 300
# The longest wait between two tries of one request when the server names none.
MAX_BACKOFF_SECONDS = 30.0


class LLMSettings(BaseSettings):
    """``DTASK_LLM_*`` (environment or ``.env``)."""

    model_config = SettingsConfigDict(env_prefix="DTASK_LLM_", env_file=".env", extra="ignore")

    # The server's base URL, ending in /v1 (http://127.0.0.1:8080/v1, https://api.openai.com/v1).
    url: str = ""
    # The model name the server knows; it is also recorded in what the model writes (a dataset's
    # generator, a graph's extractor).
    model: str = ""
    # Sent as a bearer token when set; local servers usually need none.
    api_key: SecretStr = SecretStr("")
    # Seconds one request may take (connect, send, the whole generation, read).
    timeout_seconds: float = Field(default=120.0, gt=0, le=3600, allow_inf_nan=False)
    # Requests in flight at once from this process, whatever the number of tasks and threads.
    concurrency: int = Field(default=4, ge=1, le=256)
    # Tries of one request the client makes itself on a transient failure; past them the task gets
    # LLMUnavailable (and is retried with backoff if its type is retry-safe).
    max_tries: int = Field(default=5, ge=1, le=50)
    # The most seconds one request's retries may wait in all; past it, LLMUnavailable as above.
    retry_budget_seconds: float = Field(default=60.0, ge=0, le=3600, allow_inf_nan=False)
    # First backoff (doubled each try, capped at 30 s, equal jitter) when no Retry-After says more.
    retry_backoff_seconds: float = Field(default=1.0, ge=0, le=60, allow_inf_nan=False)
    # Replies asked for when one is no valid JSON object of the expected shape (the next request
    # shows the model its reply and the error).
    json_attempts: int = Field(default=3, ge=1, le=10)
    # `json_object` sends response_format {"type": "json_object"}; `off` sends none (for servers
    # that refuse it; a 400 naming response_format also switches it off for this process).
    json_mode: str = Field(default="json_object", pattern="^(json_object|off)$")
    # Sampling: 0 makes the same request give the same reply on most servers; a seed helps others.
    temperature: float = Field(default=0.0, ge=0, le=2, allow_inf_nan=False)
    # Sent as the request's seed when set (servers that sample even at temperature 0).
    seed: int | None = None
    # The most tokens one reply may have (a question and its answer, or a chunk's entity list).
    max_tokens: int = Field(default=512, ge=1, le=100_000)


class LLMError(Exception):
    """A language-model call that did not give a usable answer."""


class LLMNotConfigured(LLMError, ValueError):
    """DTASK_LLM_URL or DTASK_LLM_MODEL is missing or malformed."""


class LLMUnavailable(LLMError, RetryableError):
    """The server did not answer in time or said to come back later: another attempt may succeed."""

    def __init__(self, message: str, *, delay: float | None = None) -> None:
        super().__init__(message, code="llm_unavailable", delay=delay)


class LLMRefused(LLMError):
    """The server refused the request itself (bad request, key, model or URL): no retry helps."""


class LLMBadOutput(LLMError):
    """The model's replies were no valid JSON object of the expected shape."""


def one_line(text: str, limit: int = MESSAGE_CHARS) -> str:
    words = " ".join(text.split())
    return words if len(words) <= limit else words[: limit - 1] + "\u2026"


def first_json_object(content: str) -> dict[str, Any]:
    """The first JSON object in a model's reply, whatever surrounds it (prose, ```json fences).

    Raises ValueError when there is none."""
    decoder = json.JSONDecoder()
    start = content.find("{")
    while start != -1:
        try:
            value, _ = decoder.raw_decode(content, start)
        except json.JSONDecodeError:
            pass
        else:
            if isinstance(value, dict):
                return value
        start = content.find("{", start + 1)
    raise ValueError("the reply holds no JSON object")


# One bound per process and server: every client of the same URL shares its slots.
_SLOTS: dict[tuple[str, int], threading.BoundedSemaphore] = {}
_SLOTS_LOCK = threading.Lock()


def _slots(url: str, concurrency: int) -> threading.BoundedSemaphore:
    with _SLOTS_LOCK:
        return _SLOTS.setdefault((url, concurrency), threading.BoundedSemaphore(concurrency))


def _check(settings: LLMSettings) -> None:
    if not settings.url:
        raise LLMNotConfigured("DTASK_LLM_URL is not set: the server's base URL, ending in /v1")
    if not settings.url.startswith(("http://", "https://")):
        raise LLMNotConfigured(f"DTASK_LLM_URL={settings.url!r} is not an http:// or https:// URL")
    if not settings.model:
        raise LLMNotConfigured("DTASK_LLM_MODEL is not set: the model name the server serves")


class LLMClient:
    """Blocking (callers run it in a thread) and safe to share between threads."""

    def __init__(self, settings: LLMSettings) -> None:
        _check(settings)
        self.settings = settings
        self.model = settings.model
        self.url = settings.url.rstrip("/") + "/chat/completions"
        headers = {"Content-Type": "application/json"}
        key = settings.api_key.get_secret_value()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self._http = httpx.Client(headers=headers, timeout=settings.timeout_seconds)
        self._slots = _slots(settings.url.rstrip("/"), settings.concurrency)
        self._json_mode = settings.json_mode == "json_object"

    def close(self) -> None:
        self._http.close()

    # -------------------------------------------------------------------------------- JSON replies

    def chat_json(self, prompt: str, shape: type[T]) -> T:
        """The model's reply to ``prompt`` as a ``shape``. A reply that is no JSON object of that
        shape is shown to the model with the error, up to DTASK_LLM_JSON_ATTEMPTS replies."""
        messages: list[dict[str, str]] = [{"role": "user", "content": prompt}]
        attempts = self.settings.json_attempts
        problem = ""
        for attempt in range(1, attempts + 1):
            content, finish = self.complete(messages)
            try:
                return shape.model_validate(first_json_object(content))
            except (ValueError, ValidationError) as exc:
                problem = _why(exc, finish)
                log.info("llm %s: reply %d of %d unusable: %s", self.model, attempt, attempts, problem)
            messages = [
                *messages[:1],
                {"role": "assistant", "content": content},
                {
                    "role": "user",
                    "content": f"That reply was not usable: {problem}. Answer again with only the "
                    "JSON object asked for, and nothing else.",
                },
            ]
        raise LLMBadOutput(
            f"model {self.model} at {self.settings.url} gave no valid JSON object in {attempts} "
            f"replies (DTASK_LLM_JSON_ATTEMPTS): {problem}"
        )

    # ---------------------------------------------------------------------------- one completion

    def complete(self, messages: list[dict[str, str]]) -> tuple[str, str | None]:
        """The first choice's content and finish reason, after the client's own retries."""
        data = self._post(messages)
        try:
            choice = data["choices"][0]
            content = choice["message"].get("content") or ""
            finish = choice.get("finish_reason")
        except (KeyError, IndexError, TypeError, AttributeError):
            raise LLMBadOutput(
                f"{self.url} answered 200 without choices[0].message: {one_line(json.dumps(data))}"
            ) from None
        if not isinstance(content, str):
            raise LLMBadOutput(f"{self.url} answered a message whose content is not text")
        return content, finish

    def _body(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        s = self.settings
        body: dict[str, Any] = {
            "model": s.model,
            "messages": messages,
            "temperature": s.temperature,
            "max_tokens": s.max_tokens,
            "stream": False,
        }
        if s.seed is not None:
            body["seed"] = s.seed
        if self._json_mode:
            body["response_format"] = {"type": "json_object"}
        return body

    def _post(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        s = self.settings
        waited, tries = 0.0, 0
        while True:
            tries += 1
            failure, asked = self._try(messages)
            if isinstance(failure, dict):
                return failure
            if failure is None:  # response_format was refused and is now off: again at once
                continue
            if asked is not None:
                wait = asked
            else:
                wait = jittered(s.retry_backoff_seconds, tries, MAX_BACKOFF_SECONDS)
            if tries >= s.max_tries or waited + wait > s.retry_budget_seconds:
                raise LLMUnavailable(
                    f"{failure} (after {tries} tries in {waited:.0f} s of waiting; DTASK_LLM_MAX_TRIES, "
                    "DTASK_LLM_RETRY_BUDGET_SECONDS)",
                    delay=asked,
                )
            log.info("llm %s: %s; try %d again in %.1f s", s.model, failure, tries + 1, wait)
            time.sleep(wait)
            waited += wait

    def _try(self, messages: list[dict[str, str]]) -> tuple[dict[str, Any] | str | None, float | None]:
        """One request: the JSON body, or why it failed transiently and the wait it asked for,
        or None if it should be sent again at once; a permanent failure raises."""
        with self._slots:
            try:
                response = self._http.post(self.url, json=self._body(messages))
            except httpx.TimeoutException as exc:
                limit = self.settings.timeout_seconds
                why = f"{self.url} did not answer within {limit:g} s (DTASK_LLM_TIMEOUT_SECONDS)"
                return f"{why}: {type(exc).__name__}", None
            except httpx.TransportError as exc:
                return f"cannot reach {self.url}: {one_line(str(exc)) or type(exc).__name__}", None
        status = response.status_code
        if status == 200:
            try:
                data = response.json()
            except ValueError:
                raise LLMBadOutput(f"{self.url} answered 200 with a body that is not JSON") from None
            if not isinstance(data, dict):
                raise LLMBadOutput(f"{self.url} answered 200 with JSON that is not an object")
            return data, None
        message = server_message(response)
        if status in RETRYABLE_STATUSES or status >= 500:
            asked = retry_after(response)
            return f"{self.url} answered {status}: {message}", asked
        if self._json_mode and status in (400, 422) and "response_format" in response.text:
            # The server does not take JSON mode: the prompt asks for JSON anyway, and the reply
            # is parsed just as robustly without it.
            log.warning("llm %s refuses response_format (%s); sending none from now on", self.model, message)
            self._json_mode = False
            return None, None
        raise LLMRefused(f"{self.url} answered {status}{_HINTS.get(status, '')}: {message}")


def _why(exc: Exception, finish: str | None) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the object"
        text = f"{where}: {first['msg']}"
    else:
        text = str(exc)
    if finish == "length":
        text += " (the reply was cut at DTASK_LLM_MAX_TOKENS)"
    return one_line(text, 200)


# One client per configuration and process: its connections are reused by every task.
_CLIENTS: dict[str, LLMClient] = {}
_CLIENTS_LOCK = threading.Lock()


def client_from_settings(settings: LLMSettings | None = None) -> LLMClient:
    """The process's client for the current DTASK_LLM_* settings (read anew each call, so a changed
    environment takes effect; an unchanged one reuses the client and its connections)."""
    settings = settings or LLMSettings()
    _check(settings)
    key = settings.model_dump_json() + settings.api_key.get_secret_value()
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = _CLIENTS[key] = LLMClient(settings)
        return client
