"""Every table Alembic owns: the runtime's, the api's and each declared domain's, all on one MetaData."""

from __future__ import annotations

import importlib

# Importing a model module registers its tables.
import app.model  # noqa: F401
import tasks_core.schedule_model  # noqa: F401
from tasks_core.domain import load_domains
from tasks_core.model import metadata as target_metadata

for _domain in load_domains():
    if _domain.metadata is not None:
        importlib.import_module(_domain.metadata)

__all__ = ["target_metadata"]
