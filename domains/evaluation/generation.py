"""Question/answer items from a base's chunks: a deterministic local generator behind an interface
a language model can implement.

The *plan* fixes which (chunk, ordinal) pairs a dataset draws, in order: ordinal 0 of every chunk
(sorted by chunk id), then ordinal 1, and so on, so the first N items of a dataset are the same
in every attempt and a resume continues exactly where the persisted items end. The generator
only writes the question and answer of each pair; ``DTASK_EVAL_GENERATOR=module:attribute``
swaps in another (an LLM client), called in a thread with a batch at a time.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from tasks_core.registry import import_path

# Questions the local generator can draw from one chunk (different windows of its words).
QUESTIONS_PER_CHUNK = 4
WINDOW = 8
_WORD = re.compile(r"\w+", re.UNICODE)


@dataclass(frozen=True)
class Chunk:
    chunk_id: str
    text: str


@dataclass(frozen=True)
class ItemRequest:
    chunk: Chunk
    ordinal: int


@dataclass(frozen=True)
class GeneratedItem:
    chunk_id: str
    ordinal: int
    question: str
    answer: str


@runtime_checkable
class ItemGenerator(Protocol):
    """What dataset generation needs: a stable name, how many items a chunk can give, and items.

    ``generate`` is blocking (callers run it in a thread) and must answer every request, in order;
    the same request should give the same item (a resume may ask again for a lost batch).
    """

    name: str
    per_chunk: int

    def generate(self, requests: Sequence[ItemRequest]) -> list[GeneratedItem]: ...


class LocalGenerator:
    """A question is a window of the chunk's words (ordinal k starts at a different place); the
    answer is the sentence around it. Lexical, so the base's default embedder finds the source."""

    name = "local"
    per_chunk = QUESTIONS_PER_CHUNK

    def generate(self, requests: Sequence[ItemRequest]) -> list[GeneratedItem]:
        return [self._one(r) for r in requests]

    def _one(self, request: ItemRequest) -> GeneratedItem:
        text = request.chunk.text
        words = _WORD.findall(text)
        if not words:
            words = [text.strip() or request.chunk.chunk_id]
        stride = max(1, (len(words) - WINDOW) // self.per_chunk) if len(words) > WINDOW else 1
        start = min(request.ordinal * stride, max(0, len(words) - WINDOW))
        window = words[start : start + WINDOW]
        question = f"Which passage says: {' '.join(window)}?"
        return GeneratedItem(request.chunk.chunk_id, request.ordinal, question, _sentence(text, window[0]))


def _sentence(text: str, word: str) -> str:
    for sentence in re.split(r"(?<=[.!?])\s+", text):
        if word in sentence:
            return sentence.strip()[:500]
    return text.strip()[:500]


def plan(chunks: Sequence[Chunk], per_chunk: int) -> Iterator[ItemRequest]:
    """Every (chunk, ordinal) a dataset may draw, in the order it draws them."""
    ordered = sorted(chunks, key=lambda c: c.chunk_id)
    for ordinal in range(per_chunk):
        for chunk in ordered:
            yield ItemRequest(chunk, ordinal)


def capacity(chunk_count: int, per_chunk: int) -> int:
    return chunk_count * per_chunk


def relevant_chunks(item: GeneratedItem, chunks: Sequence[Chunk], limit: int = 20) -> list[str]:
    """The source chunk, then other chunks that hold the answer sentence verbatim (duplicates)."""
    others = [c.chunk_id for c in chunks if c.chunk_id != item.chunk_id and item.answer in c.text]
    return [item.chunk_id, *sorted(others)[: limit - 1]]


def load_generator(spec: str) -> ItemGenerator:
    if spec == "local":
        return LocalGenerator()
    if spec == "llm":  # the DTASK_LLM_* chat client
        spec = "domains.evaluation.llm_generator:from_settings"
    try:
        target = import_path(spec)
        generator = target() if callable(target) and not isinstance(target, ItemGenerator) else target
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        raise ValueError(f"DTASK_EVAL_GENERATOR={spec!r}: {exc}") from exc
    if not isinstance(generator, ItemGenerator):
        raise ValueError(f"DTASK_EVAL_GENERATOR={spec!r} is not an ItemGenerator (name, per_chunk, generate)")
    return generator
