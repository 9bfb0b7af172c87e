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
DATASET_STATUS = "generating → completed; failed or cancelled keep their items (resume to continue)"
RUN_STATUS = "running → completed (with metrics), or failed / cancelled with its task"


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
    id: str = Field(description="The dataset's id (32 hex digits)")
    task_id: UUID = Field(description="The task generating it")
    status: DatasetStatus = Field(description=DATASET_STATUS)


class DatasetOut(BaseModel):
    id: str = Field(description="The dataset's id (32 hex digits)")
    base_id: str = Field(description="The base its items are drawn from")
    status: DatasetStatus = Field(description=DATASET_STATUS)
    item_count: int = Field(description="Items persisted so far")
    target: int = Field(description="Items asked for")
    task_id: UUID | None = Field(None, description="The task generating it (or that last did)")
    error_message: str | None = Field(None, description="Why it stopped, when it is failed or cancelled")
    generator: str | None = Field(None, description="The generator that wrote its items")
    created_at: datetime = Field(description="When it was created")
    updated_at: datetime = Field(description="When it last changed")


class ItemOut(BaseModel):
    seq: int = Field(description="Position in the dataset (0-based)")
    chunk_id: str = Field(description="The chunk the item was drawn from")
    ordinal: int = Field(description="Which question drawn from that chunk")
    question: str = Field(description="The question (a retrieval query)")
    answer: str = Field(description="The passage that answers it")
    relevant_chunk_ids: list[str] = Field(description="Chunks a retriever should return: the source first")


class ItemPage(BaseModel):
    items: list[ItemOut] = Field(description="Items in dataset order")
    next_cursor: str | None = Field(None, description="Pass back as `cursor` for the next page")


class RunIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dataset_id: Annotated[str, Field(pattern=ID, description="A completed dataset of yours")]
    base_id: Annotated[str, Field(pattern=ID, description="The base whose Milvus index is searched")]
    top_k: Annotated[
        int, Field(ge=1, le=MAX_TOP_K, description=f"Chunks retrieved per question, 1 to {MAX_TOP_K}")
    ]


class RunRef(BaseModel):
    id: str = Field(description="The run's id (32 hex digits)")
    task_id: UUID = Field(description="The task evaluating it")
    status: RunStatus = Field(description=RUN_STATUS)


class Metrics(BaseModel):
    hit_rate: float = Field(description="hit@k: share of items with a relevant chunk in the top k")
    recall: float = Field(description="recall@k: mean share of each item's relevant chunks in the top k")
    mrr: float = Field(
        description="Mean reciprocal rank of the first relevant chunk (0 when none in the top k)"
    )
    items: int = Field(description="Items evaluated")
    top_k: int = Field(description="k")


class Progress(BaseModel):
    done: int = Field(description="Items evaluated and checkpointed")
    total: int = Field(description="Items in the dataset")
    percent: float = Field(description="done / total, in percent")


class RunOut(BaseModel):
    id: str = Field(description="The run's id (32 hex digits)")
    dataset_id: str = Field(description="The dataset whose questions are asked")
    base_id: str = Field(description="The base searched")
    top_k: int = Field(description="Chunks retrieved per question")
    status: RunStatus = Field(description=RUN_STATUS)
    metrics: Metrics | None = Field(None, description="Set when the run is completed")
    progress: Progress = Field(description="Items evaluated so far")
    task_id: UUID | None = Field(None, description="The task evaluating it")
    error_message: str | None = Field(None, description="Why it stopped, when it is failed or cancelled")
    created_at: datetime = Field(description="When it was created")
    updated_at: datetime = Field(description="When it last changed")


class OutcomeOut(BaseModel):
    seq: int = Field(description="The item's position in the dataset")
    question: str = Field(description="The item's question")
    relevant_chunk_ids: list[str] = Field(description="The item's relevant chunks")
    retrieved_chunk_ids: list[str] = Field(description="The top k chunks retrieved, best first")
    hit: bool = Field(description="A relevant chunk is among them")
    rank: int | None = Field(None, description="1-based rank of the first relevant chunk, if retrieved")
    recall: float = Field(description="Share of the relevant chunks retrieved")


class OutcomePage(BaseModel):
    items: list[OutcomeOut] = Field(description="Outcomes in dataset order")
    next_cursor: str | None = Field(None, description="Pass back as `cursor` for the next page")


class EvaluationError(BaseModel):
    detail: str = Field(description="What went wrong")


class EvaluationConflict(BaseModel):
    detail: str = Field(description="What is in the way")
    task_id: UUID | None = Field(None, description="The active task in the way, if there is one")
