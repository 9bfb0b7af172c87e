"""Payload models of the evaluation task types (light: the API checks submissions against them)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

Id = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$", description="32 hex digits")]


class GeneratePayload(BaseModel):
    """Generate (or continue generating) one dataset's items, up to its target."""

    model_config = ConfigDict(extra="forbid")

    dataset_id: Id


class RunPayload(BaseModel):
    """Evaluate retrieval on one run's dataset against its base."""

    model_config = ConfigDict(extra="forbid")

    run_id: Id
