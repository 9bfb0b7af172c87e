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

from domains.cjk import CJK_CHARS

DEFAULT_DIMENSION = 1024

# A CJK run, or a word of any other script: the two never glue ("Owner统一定义" is two runs).
_TOKEN = re.compile(f"([{CJK_CHARS}]+)|[^\\W{CJK_CHARS}]+", re.UNICODE)
# Chinese function characters: as single characters they match nearly every passage (bigrams
# that contain them are kept: "为什么" still matches "为什么").
CJK_STOP_CHARS = frozenset("的了是在和与及或也就都而被把吗呢吧啊么什怎哪为之其这那个些")

# Feature kinds and their weights: w(ord), c(haracter trigram of a word), u(nigram), b(igram) of CJK.
_WEIGHTS = {"w": 1.0, "c": 0.3, "u": 1.0, "b": 1.0}


def features(text: str) -> Counter[str]:
    """The hashed features of ``text`` before hashing (exposed for tests and for reading scores)."""
    out: Counter[str] = Counter()
    for match in _TOKEN.finditer(text.lower()):
        run = match.group()
        if match.group(1) is not None:
            out.update("u:" + ch for ch in run if ch not in CJK_STOP_CHARS)
            out.update("b:" + run[i : i + 2] for i in range(len(run) - 1))
            continue
        out["w:" + run] += 1
        padded = f"^{run}$"
        out.update("c:" + padded[i : i + 3] for i in range(len(padded) - 2))
    return out


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
            digest = hashlib.blake2b(feature.encode(), digest_size=8).digest()
            value = int.from_bytes(digest, "little")
            sign = 1.0 if value & 1 else -1.0  # signed hashing: collisions cancel out on average
            weight = _WEIGHTS[feature[0]] * (1.0 + math.log(count))
            vector[(value >> 1) % self.dimension] += sign * weight
        norm = math.sqrt(sum(v * v for v in vector))
        return [v / norm for v in vector] if norm else vector
