"""Settings of the real-model clients (environment ``DTASK_*``, also read from ``.env``).

``DTASK_EMBEDDER=openai`` reads the ``DTASK_EMBEDDING_*`` ones: any server of the OpenAI-compatible
``/v1/embeddings`` API (vLLM, Ollama, TEI, infinity, a hosted provider).
"""

from __future__ import annotations

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class EmbeddingSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DTASK_", env_file=".env", extra="ignore")

    # Base URL of the OpenAI-compatible API, ending in /v1 (the client posts to <url>/embeddings),
    # e.g. http://127.0.0.1:8000/v1 for vLLM or http://127.0.0.1:11434/v1 for Ollama.
    embedding_url: str | None = None
    # The model the server is asked for; part of the embedder's name (openai:<model>), which every
    # base records, so a base is never searched or reindexed with another model's vectors.
    embedding_model: str | None = None
    # Sent as `Authorization: Bearer <key>` when set (hosted providers; local servers need none).
    embedding_api_key: SecretStr | None = None
    # Texts per request. 32 suits every server's default limit (TEI refuses more than 32).
    embedding_batch: int = Field(default=32, ge=1, le=4096)
    # The vectors' dimension. Unset: asked of the server once per process with a one-text request
    # (that first request blocks its caller for up to DTASK_EMBEDDING_TIMEOUT_SECONDS): set it in
    # production. An answer of another dimension is refused.
    embedding_dimension: int | None = Field(default=None, ge=1)
    # Requests in flight to the server from one process (a worker process runs one event loop, so
    # this bounds what its DTASK_CAPACITY concurrent files ask of the model server at once).
    embedding_concurrency: int = Field(default=4, ge=1)
    # Seconds one request may take (connect, send, wait for the vectors).
    embedding_timeout_seconds: float = Field(default=30.0, gt=0, allow_inf_nan=False)
    # How long one embedding call keeps retrying a 408, 429, 5xx or unreachable server (counted
    # from its first failure) before it gives up: the task then goes back to pending with the
    # runtime's backoff. The lease is renewed meanwhile; a lost lease or a cancel stops it at once.
    embedding_retry_seconds: float = Field(default=60.0, ge=0, allow_inf_nan=False)
    # First wait between retries; it doubles up to 10 s, with jitter. A Retry-After header from
    # the server (seconds or an HTTP date) replaces it.
    embedding_backoff_seconds: float = Field(default=0.5, gt=0, allow_inf_nan=False)

    @field_validator("embedding_url")
    @classmethod
    def _base_url(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        url = value.strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"DTASK_EMBEDDING_URL must be an http:// or https:// URL, not {value!r}")
        if url.endswith("/embeddings"):
            raise ValueError(
                "DTASK_EMBEDDING_URL is the API's base URL (e.g. http://127.0.0.1:8000/v1); "
                "the client adds /embeddings itself"
            )
        return url
