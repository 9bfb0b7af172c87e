"""The api's own tables (SQLAlchemy Core; Alembic migrates them): the dashboard's sessions."""

from __future__ import annotations

from sqlalchemy import Column, DateTime, Index, Table, Text, func

from tasks_core.model import metadata

# One row per dashboard sign-in (app/ui/session.py). The cookie holds a random id; a row holds
# only what cannot be turned back into a cookie or a key: the id's hash, and the key's name with
# a fingerprint of its secret keyed by that id.
ui_sessions = Table(
    "ui_sessions",
    metadata,
    Column("id_hash", Text, primary_key=True),  # sha256 of the cookie's session id, hex
    Column("key_name", Text, nullable=False),
    Column("key_fingerprint", Text, nullable=False),  # HMAC-SHA256(key secret, session id), hex
    Column("csrf", Text, nullable=False),  # the token forms of this session carry
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.clock_timestamp()),
    Column("expires_at", DateTime(timezone=True), nullable=False),
)
Index("ix_ui_sessions_expires_at", ui_sessions.c.expires_at)
