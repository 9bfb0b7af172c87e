"""The HTTP protocol `dtask api` serves with: uvicorn's, plus deadlines for slow clients.

uvicorn bounds the idle time between requests (keep-alive) but not the time a client takes to
send a request's headers, nor the rest of a body it no longer reads after answering early (401,
413, 503): every byte received cancels the keep-alive timer, so a client sending a byte now and
then held its connection, and a place under limit_concurrency, for ever. A body the app reads
has its deadline in ``Guard`` (app/auth.py), where a stall is answered with 408.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tasks_core.settings import get_settings


class DeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, closing a connection

    - whose request headers are not complete within DTASK_API_HEADER_TIMEOUT_SECONDS of its
      opening, or of the request's first byte on a kept-alive connection;
    - answered before its request's body was all read, when the next piece of that body takes
      longer than DTASK_API_BODY_TIMEOUT_SECONDS. Until then the rest is discarded as it comes,
      so a client that sends its whole body before reading still reads the answer.

    Pass it as uvicorn's ``http`` (`--http app.server:DeadlineProtocol`), as `dtask api` does.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = get_settings()
        self._header_timeout = settings.api_header_timeout_seconds
        self._body_timeout = settings.api_body_timeout_seconds
        # At most one deadline at a time: a request's headers come before its body, and the next
        # request's after it.
        self._deadline: asyncio.TimerHandle | None = None

    def _set(self, seconds: float, expired: Callable[[], None]) -> None:
        self._clear()
        self._deadline = self.loop.call_later(seconds, expired)

    def _clear(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_late(self) -> None:
        self._deadline = None
        self.logger.info("closing a connection whose request headers did not come in time")
        # Closes at once between requests; after a response still being sent (pipelining), once
        # it is sent.
        self.shutdown()

    def _discarded_body_late(self) -> None:
        self._deadline = None
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._set(self._header_timeout, self._headers_late)  # connecting and sending nothing is late too

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:  # one deadline per request's headers: a trickle does not renew it
            self._set(self._header_timeout, self._headers_late)

    def on_headers_complete(self) -> None:
        self._clear()
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        if self.cycle.response_complete:  # discarding the rest: each piece renews the deadline
            self._set(self._body_timeout, self._discarded_body_late)

    def on_message_complete(self) -> None:
        self._clear()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        answered_early = self.cycle.response_complete and self.cycle.more_body  # not a pipelined next one
        if answered_early and not self.transport.is_closing():
            self._set(self._body_timeout, self._discarded_body_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._clear()
        super().connection_lost(exc)
