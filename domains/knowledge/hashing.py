"""The default embedder: local, deterministic, no model (``DTASK_EMBEDDER=hashing``).

Hashed features, L2-normalised, so lexical overlap is cosine similarity; no network, no model
download. CPU work: callers run it in a thread.

Text is read as two kinds of runs. Latin (and any other space-separated script) gives words and
their character trigrams. CJK (Han, kana, Hangul) has no spaces between words, so a run of it
gives its characters and character bigrams instead: most Chinese words are one or two
characters, so a query shares bigrams with the passages that use its words, whatever a
segmenter would make of them. On the Chinese test corpus (tests/data/zh_corpus) that found the
right document first for more of the questions than jieba's words did, at about three times
the speed, and needs no dictionary.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter
from collections.abc import Sequence
from functools import lru_cache

from domains.cjk import CJK_CHARS

DEFAULT_DIMENSION = 1024

# A CJK run, or a word of any other script: the two never glue ("Owner统一定义" is two runs).
_TOKEN = re.compile(f"([{CJK_CHARS}]+)|([^\\W{CJK_CHARS}]+)")
# Chinese function characters: as single characters they match nearly every passage (bigrams
# that contain them are kept: "为什么" still matches "为什么").
CJK_STOP_CHARS = frozenset("的了是在和与及或也就都而被把吗呢吧啊么什怎哪为之其这那个些")

# Feature kinds and their weights: w(ord), c(haracter trigram of a word), u(nigram), b(igram) of CJK.
_WEIGHTS = {"w": 1.0, "c": 0.3, "u": 1.0, "b": 1.0}


def features(text: str) -> Counter[str]:
    """The hashed features of ``text`` before hashing (exposed for tests and for reading scores)."""
    found: list[str] = []  # counted once at the end: faster than a Counter updated per feature
    for cjk, word in _TOKEN.findall(text.lower()):
        if cjk:
            found += ["u:" + ch for ch in cjk if ch not in CJK_STOP_CHARS]
            found += ["b:" + cjk[i : i + 2] for i in range(len(cjk) - 1)]
        else:
            found.append("w:" + word)
            padded = f"^{word}$"
            found += ["c:" + padded[i : i + 3] for i in range(len(padded) - 2)]
    return Counter(found)


class HashingEmbedder:
    """Feature hashing of words (weight 1) and their character trigrams (0.3), and of CJK
    characters and character bigrams (1 each).

    A stable hash (blake2b, not Python's salted ``hash``) makes the vectors identical in every
    process; sublinear term frequency keeps one repeated word from dominating a chunk. The name
    carries a version: vectors of CJK text differ from those of the words-only ``hashing-N``, so a
    base built with that is refused rather than searched in a different vector space.
    """

    def __init__(self, dimension: int = DEFAULT_DIMENSION) -> None:
        self.dimension = dimension
        self.name = f"hashing-v2-{dimension}"

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        return [self._vector(text) for text in texts]

    def _vector(self, text: str) -> list[float]:
        vector = [0.0] * self.dimension
        for feature, count in features(text).items():
            slot, signed = _slot(feature, self.dimension)
            vector[slot] += signed * (1.0 + math.log(count))
        norm = math.sqrt(sum(v * v for v in vector))
        return [v / norm for v in vector] if norm else vector


@lru_cache(maxsize=1 << 14)
def _slot(feature: str, dimension: int) -> tuple[int, float]:
    """Where a feature lands and its signed weight. Cached: words, trigrams and bigrams recur from
    chunk to chunk, and the hash was most of the cost. Bounded (about 5 MB); the result is the same."""
    value = int.from_bytes(hashlib.blake2b(feature.encode(), digest_size=8).digest(), "little")
    sign = 1.0 if value & 1 else -1.0  # signed hashing: collisions cancel out on average
    return (value >> 1) % dimension, sign * _WEIGHTS[feature[0]]
