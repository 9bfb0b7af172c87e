"""CPU per chunk of the local defaults: chunking and the hashing embedder, on English prose (this
repository's README and docs) and on Chinese (the sentences of tests/data/zh_corpus dealt into
documents by a seeded shuffle). Each figure is one pass, the embedder's feature cache cleared
first, timed in process CPU time so other load on the machine counts less. Run with
``pytest -m benchmark tests/benchmarks/test_bench_text.py -s``; docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from domains.knowledge.chunking import chunk_text
from domains.knowledge.hashing import HashingEmbedder, _slot

ROOT = Path(__file__).parents[2]
# Far below what this machine does (about 1,000 to 2,000 chunks/s): a regression, not noise.
FLOOR = 200


def _english() -> str:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return "\n\n".join(p.read_text(encoding="utf-8") for p in docs)


def _chinese() -> str:
    sentences = [
        s
        for p in sorted((ROOT / "tests" / "data" / "zh_corpus" / "docs").glob("*.txt"))
        for s in re.findall(r"[^。！？\n]+[。！？]", p.read_text(encoding="utf-8"))  # noqa: RUF001
    ]
    rng = random.Random(7)
    paragraphs = ["".join(rng.choice(sentences) for _ in range(rng.randint(2, 8))) for _ in range(1500)]
    return "\n\n".join(paragraphs)


def _rate(work: Callable[[], int]) -> float:
    start = time.process_time()
    n = work()
    return n / (time.process_time() - start)


@pytest.mark.benchmark
@pytest.mark.parametrize("language", ["english", "chinese"])
def test_chunks_per_second_of_chunking_and_the_hashing_embedder(language: str) -> None:
    text = _english() if language == "english" else _chinese()
    chunks = chunk_text(text)
    _slot.cache_clear()  # the embedder's first pass over a corpus: a cold feature cache
    embedded = _rate(lambda: len(HashingEmbedder().embed(chunks)))
    chunked = _rate(lambda: len(chunk_text(text)))
    size = sum(map(len, chunks)) // len(chunks)
    print(
        f"\n{language}: {len(chunks)} chunks of {size} characters on average; "
        f"chunking {chunked:,.0f} chunks/s, embedding {embedded:,.0f} chunks/s"
    )
    assert embedded > FLOOR and chunked > FLOOR
