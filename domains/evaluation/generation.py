"""Question/answer items from a base's chunks: a deterministic local generator behind an interface
a language model can implement.

The *plan* fixes which (chunk, ordinal) pairs a dataset draws, in order: ordinal 0 of every chunk,
then ordinal 1, and so on. Within an ordinal the chunks are dealt out file by file: one chunk of
every file, then a second of every file that has one, ..., files and the chunks of a file in a
seeded pseudo-random order (a stable hash of their ids). So a dataset smaller than the base spreads
over its files rather than taking the first files' chunks, and, being a function of the chunk set
alone, the first N items of a dataset are the same in every attempt and a resume continues exactly
where the persisted items end. The generator only writes the question and answer of each pair;
``DTASK_EVAL_GENERATOR=module:attribute`` swaps in another (an LLM client), called in a thread
with a batch at a time.
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from domains.cjk import CJK_CHARS, CJK_RUN, jieba_tokenizer
from tasks_core.registry import import_path

# Questions the local generator can draw from one chunk (different windows of its words).
QUESTIONS_PER_CHUNK = 4
# Key terms a local question names.
TERMS = 6
# The plan's default seed: every dataset of a base draws the same sample (comparable runs).
SEED = "evaluation-plan-1"
_LATIN_WORD = re.compile(f"[^\\W{CJK_CHARS}]+")
# A sentence: up to its end mark, or a line's end (a heading has none).
_SENTENCE = re.compile("[^.!?。！？；…\n]+[.!?。！？；…]*")
# English words no question names.
_STOPWORD_TEXT = """the a an and or but of to in on at by for from with without into onto over under as is are
    was were be been being it its this that these those there their they them he she his her
    we you your our not no nor so if then than when while which who whom whose what where why
    how can could will would should may might must shall do does did done has have had having
    also such each every some any all most more other only very just about after before
    between during through per via"""
_STOPWORDS = frozenset(_STOPWORD_TEXT.split())


@dataclass(frozen=True)
class Chunk:
    chunk_id: str
    text: str
    # The chunk's file; "" takes it from the chunk id, which the knowledge domain writes as
    # "<file_id>-<seq>".
    file_id: str = ""

    @property
    def source(self) -> str:
        return self.file_id or self.chunk_id.rsplit("-", 1)[0]


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
    """A question names key terms of one sentence of the chunk (ordinal k takes a different
    sentence where the chunk has several), not a verbatim window of it; the answer is that
    sentence. Still lexical, so the base's default embedder finds the source: a paraphrasing
    generator is a language model's job (``DTASK_EVAL_GENERATOR=llm``)."""

    name = "local"
    per_chunk = QUESTIONS_PER_CHUNK

    def generate(self, requests: Sequence[ItemRequest]) -> list[GeneratedItem]:
        return [self._one(r) for r in requests]

    def _one(self, request: ItemRequest) -> GeneratedItem:
        text = request.chunk.text
        sentences = [m.group().strip() for m in _SENTENCE.finditer(text) if _terms(m.group())]
        if not sentences:
            fallback = text.strip()[:500] or request.chunk.chunk_id
            return GeneratedItem(
                request.chunk.chunk_id, request.ordinal, f"Which passage says: {fallback}?", fallback
            )
        # Ordinals spread over the sentences; past their number, a later slice of the terms.
        k = request.ordinal
        at = (
            (k * len(sentences)) // self.per_chunk if len(sentences) >= self.per_chunk else k % len(sentences)
        )
        sentence = sentences[at]
        terms = _terms(sentence)
        # Short sentences borrow the next one's terms, so a question is never one or two words.
        for extra in sentences[at + 1 :]:
            if len(terms) >= TERMS:
                break
            terms += [t for t in _terms(extra) if t not in terms]
        shift = (k // len(sentences)) if len(sentences) < self.per_chunk else 0
        chosen = _pick(terms, shift)
        return GeneratedItem(request.chunk.chunk_id, request.ordinal, _ask(chosen), sentence[:500])


def _terms(sentence: str) -> list[str]:
    """Content words in order of appearance, once each: Latin words of three letters or more that
    are not stop words, and Chinese words of two characters or more (jieba's segmentation)."""
    out: list[str] = []
    pos = 0
    for run in CJK_RUN.finditer(sentence):
        out += _latin_terms(sentence[pos : run.start()])
        out += [w for w in _segment(run.group()) if len(w) >= 2]
        pos = run.end()
    out += _latin_terms(sentence[pos:])
    return list(dict.fromkeys(out))


def _latin_terms(text: str) -> list[str]:
    return [
        w
        for w in _LATIN_WORD.findall(text)
        if len(w) >= 3 and w.lower() not in _STOPWORDS and not w.isdigit()
    ]


def _segment(run: str) -> list[str]:
    return list(jieba_tokenizer().cut(run, HMM=False))


def _pick(terms: list[str], shift: int) -> list[str]:
    """Up to TERMS of ``terms``, from offset ``shift`` (wrapping), kept in their text order."""
    if len(terms) <= TERMS:
        return terms
    start = (shift * TERMS) % len(terms)
    idx = sorted((start + i) % len(terms) for i in range(TERMS))
    return [terms[i] for i in idx]


def _ask(terms: list[str]) -> str:
    cjk = sum(1 for t in terms if CJK_RUN.match(t))
    if cjk * 2 >= len(terms):
        return f"哪段文字讲到{'、'.join(terms)}？"
    return f"Which passage mentions {', '.join(terms)}?"


def _rank(seed: str, key: str) -> bytes:
    return hashlib.blake2b(f"{seed}\x00{key}".encode(), digest_size=8).digest()


def plan(chunks: Sequence[Chunk], per_chunk: int, seed: str = SEED) -> Iterator[ItemRequest]:
    """Every (chunk, ordinal) a dataset may draw, in the order it draws them (module docstring)."""
    by_file: dict[str, list[Chunk]] = defaultdict(list)
    for chunk in chunks:
        by_file[chunk.source].append(chunk)
    files = sorted(by_file, key=lambda f: (_rank(seed, f), f))
    dealt = [sorted(by_file[f], key=lambda c: (_rank(seed, c.chunk_id), c.chunk_id)) for f in files]
    order = [
        own[i] for i in range(max((len(own) for own in dealt), default=0)) for own in dealt if i < len(own)
    ]
    for ordinal in range(per_chunk):
        for chunk in order:
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
        # A class or a factory is called; an instance is used as it is. (A class with the
        # protocol's attributes passes isinstance itself, so it is told apart first.)
        called = isinstance(target, type) or (callable(target) and not isinstance(target, ItemGenerator))
        generator = target() if called else target
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        raise ValueError(f"DTASK_EVAL_GENERATOR={spec!r}: {exc}") from exc
    if not isinstance(generator, ItemGenerator):
        raise ValueError(f"DTASK_EVAL_GENERATOR={spec!r} is not an ItemGenerator (name, per_chunk, generate)")
    return generator
