"""The graph domain's own settings (environment or .env, like the runtime's): DTASK_GRAPH_*."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class GraphSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DTASK_GRAPH_", env_file=".env", extra="ignore")

    # `capitalised` (the deterministic local extractor: capitalised runs, Chinese names), `llm`, or
    # `module:attribute` naming another.
    extractor: str = "capitalised"
    # Chunks per checkpoint: one owning transaction adds their counts and moves the checkpoint.
    batch_chunks: int = Field(default=64, ge=1, le=10_000)
