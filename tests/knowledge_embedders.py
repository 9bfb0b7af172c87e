"""Embedders for the system tests, loaded by worker processes through DTASK_EMBEDDER.

``GateEmbedder`` embeds exactly like the default (same name, same vectors), but from its second
call in a process on it waits while the file named by DTASK_TEST_EMBED_GATE exists, after touching
``<gate>.entered``: a test can hold a worker in the middle of indexing a file (one batch of its
vectors already in Milvus) and SIGKILL it there.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from domains.knowledge.hashing import HashingEmbedder


class GateEmbedder(HashingEmbedder):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.calls += 1
        gate = Path(os.environ["DTASK_TEST_EMBED_GATE"])
        if self.calls > 1 and gate.exists():
            Path(f"{gate}.entered").touch()
            while gate.exists():
                time.sleep(0.05)
        return super().embed(texts)
