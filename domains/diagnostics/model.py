"""diagnostics_runs: one domain row per diagnostics task, owned by the attempt that runs it.

It is the smallest real example of the domain pattern the runtime promises (I6): the handler
marks the row in-progress inside an owning transaction, and the task's terminal hook converges it.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    ForeignKey,
    Integer,
    Table,
    Text,
    func,
)
from sqlalchemy.dialects.postgresql import UUID

# Domain tables share the runtime's metadata so their foreign keys to `tasks` resolve.
from tasks_core.model import metadata

diagnostics_runs = Table(
    "diagnostics_runs",
    metadata,
    Column("task_id", UUID(as_uuid=True), ForeignKey("tasks.id", ondelete="CASCADE"), primary_key=True),
    Column("attempt_token", UUID(as_uuid=True), nullable=True),
    Column("status", Text, nullable=False),
    Column("steps_done", Integer, nullable=False, server_default="0"),
    # Which terminal hook converged the row, and the task status it saw.
    Column("hook", Text, nullable=True),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.clock_timestamp()),
    CheckConstraint("status IN ('running', 'done', 'failed', 'cancelled')", name="status"),
)

# Side effects written inside owning transactions, stamped with the writing attempt's token:
# the fault campaign's checker proves from them that no non-owner write was ever committed (I2).
diagnostics_effects = Table(
    "diagnostics_effects",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("task_id", UUID(as_uuid=True), ForeignKey("tasks.id", ondelete="CASCADE"), nullable=False),
    Column("attempt_token", UUID(as_uuid=True), nullable=False),
    Column("step", Integer, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.clock_timestamp()),
)
