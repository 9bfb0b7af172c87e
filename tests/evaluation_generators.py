"""Generators for the system tests, loaded by worker processes through DTASK_EVAL_GENERATOR.

``GateGenerator`` writes exactly the local generator's items, but a batch asking for an ordinal of
at least DTASK_TEST_GEN_GATE_ORDINAL waits while the file named by DTASK_TEST_GEN_GATE exists,
after touching ``<gate>.entered``: with a base of n chunks and a batch size dividing n, a dataset
is held with exactly n items committed (every chunk's ordinal 0), in any worker process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from domains.evaluation.generation import GeneratedItem, ItemRequest, LocalGenerator


class GateGenerator(LocalGenerator):
    def generate(self, requests: Sequence[ItemRequest]) -> list[GeneratedItem]:
        gate = Path(os.environ["DTASK_TEST_GEN_GATE"])
        held = int(os.environ.get("DTASK_TEST_GEN_GATE_ORDINAL", "1"))
        if any(r.ordinal >= held for r in requests) and gate.exists():
            Path(f"{gate}.entered").touch()
            while gate.exists():
                time.sleep(0.05)
        return super().generate(requests)
