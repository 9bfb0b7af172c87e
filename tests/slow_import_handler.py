"""A handler module whose import takes longer than a short lease (like one that pulls in numpy
under load): the runtime must keep the lease while it loads."""

from __future__ import annotations

import time
from typing import Any

from tasks_core.worker.context import TaskContext

time.sleep(2.5)


async def run(ctx: TaskContext) -> Any:
    return {"imported": True}
