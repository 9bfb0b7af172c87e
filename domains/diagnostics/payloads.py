"""Payload models of the diagnostics types: every parameter bounded, unknown fields refused."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

_STRICT = ConfigDict(extra="forbid", strict=True)
# A diagnostics sleep writes at most one effect row per step: this bounds the rows a task can write.
MAX_STEPS = 100_000
MAX_SLEEP_SECONDS = 24 * 3600.0


class SleepPayload(BaseModel):
    model_config = _STRICT

    seconds: Annotated[float, Field(ge=0, le=MAX_SLEEP_SECONDS, allow_inf_nan=False)] = 1.0
    steps: Annotated[int, Field(ge=1, le=MAX_STEPS)] = 1
    effects: Annotated[bool, Field(description="each step writes a row in an owning transaction")] = False


class FailPayload(BaseModel):
    model_config = _STRICT

    message: Annotated[str, Field(max_length=1000)] = "diagnostics.fail raised on purpose"


class FlakyPayload(BaseModel):
    model_config = _STRICT

    fail_times: Annotated[int, Field(ge=0, le=100, description="attempts that fail before one succeeds")] = 1
