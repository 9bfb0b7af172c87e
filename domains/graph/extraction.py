"""Entities and co-occurrences from chunk texts, with a deterministic local extractor by default.

``EntityExtractor`` is the seam: anything with a ``name`` and ``extract(text) -> [names]`` (every
occurrence, in order) can be plugged in through DTASK_GRAPH_EXTRACTOR, e.g. a language model. The
default, ``CapitalisedTermExtractor``, takes runs of capitalised words ("Marie Curie", "University
of Paris", "NASA"); a lone capitalised word that opens a sentence is skipped, since in English it
is usually just capitalised for that reason. Chinese has no capitals: its names are the words
jieba's part-of-speech tagger marks as a person (nr), place (ns), organisation (nt) or other
proper noun (nz). A Latin run and a CJK run are never one name ("Owner统一定义" gives "Owner" at
most). Generic words ("String", "NULL") are not names, and a short name written in full in the
same chunk ("CLI" beside "AWS CLI") counts as the full one. The same text always gives the same
entities.

The build then keeps only the entities of at least ``min_chunks(total)`` chunks (see there): an
entity seen once in a large base is more often noise than a subject.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any, Protocol

from domains.cjk import CJK_CHARS, CJK_RUN, jieba_tagger
from tasks_core.registry import import_path


class EntityExtractor(Protocol):
    @property
    def name(self) -> str: ...

    def extract(self, text: str) -> list[str]:
        """Every entity occurrence in ``text``, in order, as its canonical name."""
        ...


# A word: a letter first, then letters, digits, apostrophes or hyphens inside. No CJK character:
# the tagger reads those.
_W = f"[^\\W{CJK_CHARS}]"
_WORD = re.compile(f"[^\\W\\d_{CJK_CHARS}]{_W}*(?:['\u2019-]+{_W}+)*")
# What between two words ends a sentence (a line break too: a heading or list item starts afresh).
_SENTENCE_END = re.compile("[.!?:;\n\u3002\uff01\uff1f\uff1b\uff1a]")
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
# Single words that are capitalised in documents (headings, code, tables) without naming anything.
_GENERIC = """string document documents result results null none true false nan error errors exception
    example examples note notes warning warnings tip tips important todo info debug see
    type types value values data file files object objects list lists table tables figure fig
    section chapter page step steps part item items summary overview introduction conclusion
    returns return parameters parameter params args arguments default defaults response request
    name names id key keys input output description usage options option config configuration
    version status message text number int float bool boolean array dict map set class function method
    new old get post put delete update create read write run start stop yes ok q a"""
GENERIC_WORDS = frozenset(_GENERIC.split())
# Chinese parts of speech that mark a name: person (nr, nrfg), place (ns), organisation (nt),
# other proper noun (nz). "nrt" (transliterated names) is left out: in technical text it is mostly
# loanwords the dictionary tags so ("比特", "令牌").
CJK_NAME_TAGS = frozenset({"nr", "nrfg", "ns", "nt", "nz"})
# Common words the dictionary tags as names; as entities they are noise.
_CJK_GENERIC = """索引 城市 太阳 海洋 山区 山林 东南 西北 东北 西南 中断 入门 加密 苏醒 端正 耐力 高清 须知
    凌空 银行卡 特许权 台风 太阳光 天气晴朗"""
CJK_GENERIC = frozenset(_CJK_GENERIC.split())
# The most common Chinese surnames: a person's name the dictionary does not know starts with one.
CJK_SURNAMES = frozenset(
    "王李张刘陈杨黄赵吴周徐孙马朱胡郭何高林罗郑梁谢宋唐许韩冯邓曹彭曾肖田董袁潘于蒋蔡余杜叶程苏魏吕丁"
    "任沈姚卢姜崔钟谭陆汪范金石廖贾夏韦付方白邹孟熊秦邱江尹薛闫段雷侯龙史陶黎贺顾毛郝龚邵万钱严覃武戴"
    "莫孔向汤欧常"
)
# Function characters the tagger sometimes fuses onto the front of a name ("于长江", "从立春").
_CJK_LEADING = frozenset("和于从在与对向把被将及")
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
    """The default extractor: capitalised Latin runs and tagged Chinese names (module docstring).

    ``name`` is recorded by every graph build; it changes whenever the entities of a text do.
    """

    name: str = "capitalised-v2"
    min_chars: int = 2
    cjk: bool = True

    def extract(self, text: str) -> list[str]:
        found = self._latin(text)
        if self.cjk and CJK_RUN.search(text):
            found = _in_text_order(text, found, _cjk_names(text))
        return _merge_short_forms(found)

    def _latin(self, text: str) -> list[str]:
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
            if len(words) == 1 and term.lower() in GENERIC_WORDS:
                return  # "String", "NULL": capitalised, but no subject of the text
            found.append(term)

        previous_end = 0
        for match in _WORD.finditer(text):
            gap = text[previous_end : match.start()]
            previous_end = match.end()
            if _SENTENCE_END.search(gap):
                close()
                sentence_start = True
            elif gap.strip():
                close()  # a comma, bracket, quote or CJK text: the name (if any) ended there
                if CJK_RUN.search(gap):
                    sentence_start = False  # "用 Python 写": the sentence opened before the word
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


# ------------------------------------------------------------------------------------------------ CJK


def _cjk_names(text: str) -> list[tuple[int, str]]:
    """(offset, name) of each tagged Chinese name, in order: each CJK run tagged on its own, so a
    name never takes in a Latin neighbour."""
    tagger = jieba_tagger()
    out: list[tuple[int, str]] = []
    for run in CJK_RUN.finditer(text):
        at = run.start()
        singles: list[str] = []  # consecutive one-character words: what the dictionary did not know
        # HMM=False: dictionary words only. The tagger's HMM for unknown words makes tagging about
        # six times slower and mostly yields fragments ("黑方先", "从立春"); people's names, the
        # unknown words that matter, are found in the leftover single characters instead.
        for pair in tagger.cut(run.group(), HMM=False):
            word, flag = pair.word, pair.flag
            if len(word) == 1:
                singles.append(word)
            else:
                out.extend(_unknown_people(singles, at - len(singles)))
                singles = []
                _add_name(out, tagger, at, word, flag)
            at += len(word)
        out.extend(_unknown_people(singles, at - len(singles)))
    return out


def _add_name(out: list[tuple[int, str]], tagger: Any, at: int, word: str, flag: str) -> None:
    if flag not in CJK_NAME_TAGS:
        return
    if word[0] in _CJK_LEADING and len(word) > 2 and tagger.word_tag_tab.get(word[1:]) in CJK_NAME_TAGS:
        word, at = word[1:], at + 1  # "于长江" -> "长江"
    if word not in CJK_GENERIC:
        out.append((at, word))


def _unknown_people(singles: list[str], at: int) -> list[tuple[int, str]]:
    """People among characters the dictionary split one by one ("马", "云", "在"): jieba's
    word-boundary HMM groups them ("马云", "在"), and a word of two or three that starts with a
    common surname is taken for a person."""
    if len(singles) < 2:
        return []
    from jieba import finalseg  # loaded with the tagger

    found = []
    for word in finalseg.cut("".join(singles)):
        if 2 <= len(word) <= 3 and word[0] in CJK_SURNAMES:
            found.append((at, word))
        at += len(word)
    return found


def _in_text_order(text: str, latin: list[str], cjk: list[tuple[int, str]]) -> list[str]:
    """Latin and CJK names merged by where they occur (each Latin name found at or after the
    previous one), so "every occurrence, in order" holds for mixed text."""
    placed: list[tuple[int, int, str]] = []
    at = 0
    for name in latin:
        where = text.find(name, at)
        where = at if where < 0 else where
        placed.append((where, 0, name))
        at = where + len(name) if where >= at else at
    placed.extend((where, 1, name) for where, name in cjk)
    return [name for _, _, name in sorted(placed, key=lambda p: (p[0], p[1]))]


def _merge_short_forms(names: list[str]) -> list[str]:
    """A name that is the first or last words of exactly one longer name of the same text counts as
    that one ("CLI" beside "AWS CLI", "S3" beside "Amazon S3"); with two candidates ("CLI" beside
    "AWS CLI" and "Azure CLI") it stays as it is. Per text, so the result never depends on batches."""
    distinct = sorted(set(names))
    full: dict[str, str] = {}
    for short in distinct:
        longer = [
            n for n in distinct if n != short and (n.endswith(" " + short) or n.startswith(short + " "))
        ]
        if len(longer) == 1:
            full[short] = longer[0]
    return [full.get(n, n) for n in names]


# ------------------------------------------------------------------------------------------------ counts

# Entities of fewer chunks than this are dropped when a build finishes, in bases of at least
# SMALL_BASE_CHUNKS chunks; a smaller base (a single document) keeps every name it has.
MIN_CHUNKS = 2
SMALL_BASE_CHUNKS = 20


def min_chunks(total_chunks: int) -> int:
    """How many chunks an entity needs to stay in a graph of ``total_chunks`` chunks."""
    return MIN_CHUNKS if total_chunks >= SMALL_BASE_CHUNKS else 1


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
