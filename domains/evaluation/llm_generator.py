"""``DTASK_EVAL_GENERATOR=llm``: a language model writes each item's question and reference answer.

Which items a dataset draws stays the plan's (generation.plan: deterministic, resumable); the model
only writes the (chunk, ordinal) pairs it is handed, one request each, at temperature 0 by default so
that a batch asked for again (after a lost attempt) reads the same. The prompt is
``domains/evaluation/prompts/question.txt`` or the file DTASK_EVAL_LLM_PROMPT names; its placeholders:

- ``{text}``: the chunk's text (at most DTASK_EVAL_LLM_MAX_INPUT_CHARS characters of it)
- ``{ordinal}``: which question of this chunk it is, from 1
- ``{per_chunk}``: how many questions a chunk may give (DTASK_EVAL_LLM_PER_CHUNK)

The generator's ``name``, recorded on the dataset, holds the model and the prompt's digest.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

from pydantic import BaseModel, Field, StringConstraints
from pydantic_settings import BaseSettings, SettingsConfigDict

from domains.evaluation.generation import GeneratedItem, ItemRequest
from domains.llm_client import LLMClient, client_from_settings
from domains.llm_prompt import Prompt, load_prompt

PLACEHOLDERS = ("text", "ordinal", "per_chunk")


class LLMGeneratorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DTASK_EVAL_LLM_", env_file=".env", extra="ignore")

    # A prompt file of your own instead of the shipped question.txt (same placeholders).
    prompt: str = ""
    # Questions one chunk may give: a dataset of more items than chunks needs more than 1.
    per_chunk: int = Field(default=1, ge=1, le=20)
    # A longer chunk is cut here before it is sent (the question comes from what is left).
    max_input_chars: int = Field(default=6000, ge=100, le=1_000_000)


class QuestionAnswer(BaseModel):
    question: Annotated[str, StringConstraints(strip_whitespace=True, min_length=3, max_length=2000)]
    answer: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=4000)]


class LLMGenerator:
    def __init__(self, client: LLMClient, prompt: Prompt, per_chunk: int = 1, max_input_chars: int = 6000):
        self.client = client
        self.prompt = prompt
        self.per_chunk = per_chunk
        self.max_input_chars = max_input_chars
        self.name = f"llm:{client.model} prompt:{prompt.digest}"

    def generate(self, requests: Sequence[ItemRequest]) -> list[GeneratedItem]:
        if len(requests) <= 1:
            return [self._one(r) for r in requests]
        # Concurrent requests (bounded by DTASK_LLM_CONCURRENCY in the client), answered in order.
        workers = min(len(requests), self.client.settings.concurrency)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="llm-generate") as pool:
            futures = [pool.submit(self._one, r) for r in requests]
            try:
                return [f.result() for f in futures]
            finally:
                for f in futures:
                    f.cancel()  # a failure ends the batch: the requests not sent yet are not

    def _one(self, request: ItemRequest) -> GeneratedItem:
        prompt = self.prompt.render(
            text=request.chunk.text[: self.max_input_chars],
            ordinal=request.ordinal + 1,
            per_chunk=self.per_chunk,
        )
        reply = self.client.chat_json(prompt, QuestionAnswer)
        return GeneratedItem(request.chunk.chunk_id, request.ordinal, reply.question, reply.answer)


def from_settings() -> LLMGenerator:
    """The generator DTASK_EVAL_GENERATOR=llm loads: DTASK_LLM_* and DTASK_EVAL_LLM_* as set now."""
    settings = LLMGeneratorSettings()
    prompt = load_prompt(
        "domains.evaluation", "question.txt", settings.prompt, "DTASK_EVAL_LLM_PROMPT", PLACEHOLDERS
    )
    return LLMGenerator(client_from_settings(), prompt, settings.per_chunk, settings.max_input_chars)
