"""TaskStore: the one object the runtime, the API and the tools hold for the task tables.

It composes the store's parts, each a module of its own: submit and publish (submit), the
owner's fenced writes (owner), convergence and clean-up by others (maintenance, which brings the
claim (claim): both repair the slot rows), paused types (pauses) and reads (reads); the SQL they
run is in statements.
"""

from __future__ import annotations

from tasks_core.store.maintenance import Maintenance
from tasks_core.store.owner import OwnerWrites
from tasks_core.store.pauses import Pauses
from tasks_core.store.reads import Reads
from tasks_core.store.submit import Submit


class TaskStore(Submit, OwnerWrites, Maintenance, Pauses, Reads):
    """All SQL that touches the task row and its attempts. Tests may pin "now" by setting
    ``now``; it replaces ``clock_timestamp()`` in every statement."""
