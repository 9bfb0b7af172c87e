"""The default embedder: local, deterministic, no model (``DTASK_EMBEDDER=hashing``).

Hashed word and character-trigram features, L2-normalised, so lexical overlap is cosine
similarity; no network, no model download. CPU work: callers run it in a thread.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter
from collections.abc import Sequence

DEFAULT_DIMENSION = 1024
_WORD = re.compile(r"\w+", re.UNICODE)


class HashingEmbedder:
    """Feature hashing of words (weight 1) and character trigrams of words (weight 0.3).

    A stable hash (blake2b, not Python's salted ``hash``) makes the vectors identical in every
    process; sublinear term frequency keeps one repeated word from dominating a chunk.
    """

    def __init__(self, dimension: int = DEFAULT_DIMENSION) -> None:
        self.dimension = dimension
        self.name = f"hashing-{dimension}"

    def _features(self, text: str) -> Counter[str]:
        features: Counter[str] = Counter()
        for word in _WORD.findall(text.lower()):
            features["w:" + word] += 1
            padded = f"^{word}$"
            for i in range(len(padded) - 2):
                features["c:" + padded[i : i + 3]] += 1
        return features

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        return [self._vector(text) for text in texts]

    def _vector(self, text: str) -> list[float]:
        vector = [0.0] * self.dimension
        for feature, count in self._features(text).items():
            digest = hashlib.blake2b(feature.encode(), digest_size=8).digest()
            value = int.from_bytes(digest, "little")
            sign = 1.0 if value & 1 else -1.0  # signed hashing: collisions cancel out on average
            weight = (1.0 if feature[0] == "w" else 0.3) * (1.0 + math.log(count))
            vector[(value >> 1) % self.dimension] += sign * weight
        norm = math.sqrt(sum(v * v for v in vector))
        return [v / norm for v in vector] if norm else vector
