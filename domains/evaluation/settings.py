"""The evaluation domain's own settings (environment ``DTASK_EVAL_*``, also read from ``.env``)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

# The largest dataset one request may ask for (stated in the API's 422 and in the README).
MAX_DATASET_SIZE = 1000
MAX_TOP_K = 100


class EvaluationSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DTASK_EVAL_", env_file=".env", extra="ignore")

    # `local` (deterministic, no network), `llm`, or `module:attribute` naming an ItemGenerator.
    generator: str = "local"
    # Items generated and committed per owning transaction: what a crash can cost at most.
    batch_size: Annotated[int, Field(ge=1, le=1000)] = 20
    # Seconds to wait after each generated batch: keeps a model's API under its rate limit.
    batch_pause_seconds: Annotated[float, Field(ge=0, le=3600)] = 0.0
    # Dataset items evaluated (searched and checkpointed) per owning transaction of a run.
    run_batch_size: Annotated[int, Field(ge=1, le=1000)] = 50
