"""Every table Alembic owns: the runtime's, the api's and each domain's, all on one MetaData."""

from __future__ import annotations

# Importing a model module registers its tables.
import app.model  # noqa: F401
import domains.diagnostics.model
import domains.evaluation.model
import domains.graph.model
import domains.knowledge.model  # noqa: F401
from tasks_core.model import metadata as target_metadata

__all__ = ["target_metadata"]
