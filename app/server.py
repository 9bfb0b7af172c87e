"""The HTTP protocol `dtask api` serves with: uvicorn's, plus a deadline for request headers.

uvicorn bounds the idle time between requests (keep-alive) but not the time a client takes to
send a request's headers: every byte it receives restarts the keep-alive timer, so a client
sending headers a byte at a time holds its connection, and a place under limit_concurrency, for
ever. The body has its deadline in ``Guard`` (app/auth.py), where a stall can be answered with 408.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tasks_core.settings import get_settings


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, closing a connection whose request headers are not complete
    within DTASK_API_HEADER_TIMEOUT_SECONDS of its opening, or of the request's first byte on a
    kept-alive connection. Pass it as uvicorn's ``http`` (`--http app.server:HeaderDeadlineProtocol`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout = get_settings().api_header_timeout_seconds
        self._header_timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        if self._header_timer is None:  # one deadline per request: a trickle does not renew it
            self._header_timer = self.loop.call_later(self._header_timeout, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        self.logger.info("closing a connection whose request headers did not come in time")
        # Closes at once between requests; after a response still being sent (pipelining), once
        # it is sent.
        self.shutdown()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # a client that connects and sends nothing is late too

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
