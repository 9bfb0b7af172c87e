"""Every table Alembic owns: the runtime's and each domain's (tests compare them to migrations)."""

from __future__ import annotations

from domains.diagnostics.model import metadata as diagnostics_metadata
from tasks_core.model import metadata as core_metadata

target_metadata = [core_metadata, diagnostics_metadata]
