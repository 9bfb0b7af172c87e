"""An extractor for the system tests, loaded by worker processes through DTASK_GRAPH_EXTRACTOR.

``GateExtractor`` extracts exactly like the default (same name, same entities), but once it has
extracted DTASK_TEST_GRAPH_HOLD_AFTER chunks in a process, it touches ``<gate>.entered`` and waits
while the file named by DTASK_TEST_GRAPH_GATE exists: a test can hold a worker in the middle of a
build (some batches already committed) and SIGKILL it there.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from domains.graph.extraction import CapitalisedTermExtractor


class GateExtractor:
    name = CapitalisedTermExtractor.name

    def __init__(self) -> None:
        self._inner = CapitalisedTermExtractor()
        self.calls = 0

    def extract(self, text: str) -> list[str]:
        self.calls += 1
        gate = Path(os.environ["DTASK_TEST_GRAPH_GATE"])
        if self.calls > int(os.environ["DTASK_TEST_GRAPH_HOLD_AFTER"]) and gate.exists():
            Path(f"{gate}.entered").touch()
            while gate.exists():
                time.sleep(0.05)
        return self._inner.extract(text)
