"""Every table Alembic owns: the runtime's and each domain's, all on one MetaData."""

from __future__ import annotations

import domains.diagnostics.model  # noqa: F401  (registers its tables)
from tasks_core.model import metadata as target_metadata

__all__ = ["target_metadata"]
