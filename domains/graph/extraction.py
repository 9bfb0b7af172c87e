"""Entities and co-occurrences from chunk texts, with a deterministic local extractor by default.

``EntityExtractor`` is the seam: anything with a ``name`` and ``extract(text) -> [names]`` (every
occurrence, in order) can be plugged in through DTASK_GRAPH_EXTRACTOR, e.g. a language model. The
default, ``CapitalisedTermExtractor``, takes runs of capitalised words ("Marie Curie", "University
of Paris", "NASA"); a lone capitalised word that opens a sentence is skipped, since in English it
is usually just capitalised for that reason. The same text always gives the same entities.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import combinations
from typing import Protocol

from tasks_core.registry import import_path


class EntityExtractor(Protocol):
    @property
    def name(self) -> str: ...

    def extract(self, text: str) -> list[str]:
        """Every entity occurrence in ``text``, in order, as its canonical name."""
        ...


# A word: a letter first, then letters, digits, apostrophes or hyphens inside.
_WORD = re.compile("[^\\W\\d_](?:[\\w'\u2019-]*\\w)?")
# What between two words ends a sentence (a line break too: a heading or list item starts afresh).
_SENTENCE_END = re.compile(r"[.!?:;\n]")
# Small words that may sit inside a name ("Bank of England", "Ludwig van Beethoven").
CONNECTORS = frozenset({"of", "de", "del", "der", "van", "von", "la", "le", "du", "da"})
# Capitalised words that open a run without being part of a name ("The Louvre" -> "Louvre").
_STOPWORDS = """a an the this that these those there then when while where what which who whom whose why how
    in on at by for from to into onto with without within of and or but nor so yet if as after
    before during since until because although though however therefore thus also moreover
    it its he she they we you i his her their our your my me him them us is are was were be been
    not no yes all any each every some many most more other such one two three first second last
    meanwhile yesterday today tomorrow later now here finally still
    mr mrs ms dr prof"""
STOPWORDS = frozenset(_STOPWORDS.split())
MAX_WORDS = 6
# Longer names are dropped, whatever the extractor: a name is a primary-key column (btree entries
# are limited to about 2.7 kB) and nobody browses a graph by a paragraph.
MAX_NAME_CHARS = 200


def _capitalised(word: str) -> bool:
    return word[0].isupper()


def _clean(word: str) -> str:
    # Possessives belong to the name they follow: "Curie's" -> "Curie".
    for suffix in ("'s", "\u2019s"):
        if word.endswith(suffix):
            return word[: -len(suffix)]
    return word


@dataclass(frozen=True)
class CapitalisedTermExtractor:
    name: str = "capitalised"
    min_chars: int = 2

    def extract(self, text: str) -> list[str]:
        found: list[str] = []
        run: list[str] = []
        run_opens_sentence = False
        sentence_start = True

        def close() -> None:
            words = list(run)
            while words and words[-1].lower() in CONNECTORS:
                words.pop()
            opens = run_opens_sentence
            while words and words[0].lower() in STOPWORDS:
                words.pop(0)
                opens = False  # what is left did not open the sentence
            run.clear()
            if not words or len(words) > MAX_WORDS:
                return
            term = " ".join(words)
            if len(term) < self.min_chars:
                return
            if opens and len(words) == 1 and not (term.isupper() and len(term) > 1):
                return  # "Yesterday ..." - capitalised only because it opens the sentence
            found.append(term)

        previous_end = 0
        for match in _WORD.finditer(text):
            gap = text[previous_end : match.start()]
            previous_end = match.end()
            if _SENTENCE_END.search(gap):
                close()
                sentence_start = True
            elif gap.strip():
                close()  # a comma, bracket or quote: the name (if any) ended there
            word = _clean(match.group())
            if _capitalised(word):
                if not run:
                    run_opens_sentence = sentence_start
                run.append(word)
            elif run and word.lower() in CONNECTORS:
                run.append(word)
            else:
                close()
            sentence_start = False
        close()
        return found


@dataclass
class BatchCounts:
    """What a batch of chunks adds to a graph: per entity (mentions, chunks), per edge its weight."""

    mentions: Counter[str] = field(default_factory=Counter)
    chunks: Counter[str] = field(default_factory=Counter)
    edges: Counter[tuple[str, str]] = field(default_factory=Counter)

    def add_chunk(self, names: Iterable[str]) -> None:
        occurrences = [n for n in names if _storable(n)]
        self.mentions.update(occurrences)
        distinct = sorted(set(occurrences))
        self.chunks.update(distinct)
        # Each pair once per chunk, stored as (smaller, larger): an undirected edge.
        self.edges.update(combinations(distinct, 2))


def _storable(name: str) -> bool:
    return (
        isinstance(name, str)
        and 0 < len(name) <= MAX_NAME_CHARS
        and "\x00" not in name
        and name.strip() == name
    )


def count_chunks(extractor: EntityExtractor, texts: Iterable[str]) -> BatchCounts:
    counts = BatchCounts()
    for text in texts:
        counts.add_chunk(extractor.extract(text))
    return counts


def load_extractor(spec: str) -> EntityExtractor:
    """``capitalised`` (the default), or ``module:attribute`` naming an extractor class or factory."""
    if spec == "capitalised":
        return CapitalisedTermExtractor()
    if spec == "llm":  # the DTASK_LLM_* chat client
        spec = "domains.graph.llm_extractor:from_settings"
    target = import_path(spec)
    # A class or a factory is called; an instance is used as it is.
    called = isinstance(target, type) or (callable(target) and not hasattr(target, "extract"))
    extractor = target() if called else target
    name = getattr(extractor, "name", None)
    if not callable(getattr(extractor, "extract", None)) or not isinstance(name, str):
        raise ValueError(f"{spec} is not an entity extractor (needs a name and extract(text))")
    return extractor  # type: ignore[no-any-return]
