"""Request and response bodies of the /evaluation routes (they are the OpenAPI document)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field

from domains.evaluation.settings import MAX_DATASET_SIZE, MAX_TOP_K

ID = r"^[0-9a-f]{32}$"
DatasetStatus = Literal["generating", "completed", "failed", "cancelled"]
RunStatus = Literal["running", "completed", "failed", "cancelled"]


class DatasetIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    base_id: Annotated[str, Field(pattern=ID, description="The knowledge base to draw items from")]
    size: Annotated[
        int,
        Field(
            ge=1,
            le=MAX_DATASET_SIZE,
            description=f"Items: 1 to {MAX_DATASET_SIZE}, and at most what the base's chunks give",
        ),
    ]


class DatasetRef(BaseModel):
    id: str
    task_id: UUID
    status: DatasetStatus


class DatasetOut(BaseModel):
    id: str
    base_id: str
    status: DatasetStatus = Field(
        description="generating → completed; failed or cancelled keep their items (resume to continue)"
    )
    item_count: int = Field(description="Items persisted so far")
    target: int = Field(description="Items asked for")
    task_id: UUID | None = Field(None, description="The task generating it (or that last did)")
    error_message: str | None = None
    generator: str | None = None
    created_at: datetime
    updated_at: datetime


class ItemOut(BaseModel):
    seq: int = Field(description="Position in the dataset (0-based)")
    chunk_id: str = Field(description="The chunk the item was drawn from")
    ordinal: int = Field(description="Which question drawn from that chunk")
    question: str
    answer: str
    relevant_chunk_ids: list[str]


class ItemPage(BaseModel):
    items: list[ItemOut]
    next_cursor: str | None = Field(None, description="Pass back as `cursor` for the next page")


class RunIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dataset_id: Annotated[str, Field(pattern=ID, description="A completed dataset of yours")]
    base_id: Annotated[str, Field(pattern=ID, description="The base whose Milvus index is searched")]
    top_k: Annotated[
        int, Field(ge=1, le=MAX_TOP_K, description=f"Chunks retrieved per question, 1 to {MAX_TOP_K}")
    ]


class RunRef(BaseModel):
    id: str
    task_id: UUID
    status: RunStatus


class Metrics(BaseModel):
    hit_rate: float = Field(description="hit@k: share of items with a relevant chunk in the top k")
    recall: float = Field(description="recall@k: mean share of each item's relevant chunks in the top k")
    mrr: float = Field(
        description="Mean reciprocal rank of the first relevant chunk (0 when none in the top k)"
    )
    items: int
    top_k: int


class Progress(BaseModel):
    done: int
    total: int
    percent: float


class RunOut(BaseModel):
    id: str
    dataset_id: str
    base_id: str
    top_k: int
    status: RunStatus
    metrics: Metrics | None = Field(None, description="Set when the run is completed")
    progress: Progress
    task_id: UUID | None = None
    error_message: str | None = None
    created_at: datetime
    updated_at: datetime


class OutcomeOut(BaseModel):
    seq: int
    question: str
    relevant_chunk_ids: list[str]
    retrieved_chunk_ids: list[str]
    hit: bool
    rank: int | None = Field(None, description="1-based rank of the first relevant chunk, if retrieved")
    recall: float


class OutcomePage(BaseModel):
    items: list[OutcomeOut]
    next_cursor: str | None = None


class EvaluationError(BaseModel):
    detail: str


class EvaluationConflict(BaseModel):
    detail: str
    task_id: UUID | None = Field(None, description="The active task in the way, if there is one")
