"""Connection-level limits uvicorn lacks: a deadline for each request's headers.

uvicorn closes a kept-alive connection idle for ``timeout_keep_alive``, but a fresh connection
that sends nothing, or sends its headers a byte at a time, is kept forever. Here each
connection must complete a request's headers within ``header_timeout_s`` of opening, and of
each response's end; else it is closed. With the connection cap (``limit_concurrency``) and
the body timeout (``gateway.admission``), a crowd of idle or slow clients holds no resource
for long.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


class HeaderDeadlineH11(H11Protocol):
    header_timeout_s = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()  # the next request's headers have as long

    def _arm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_deadline)

    def _header_deadline(self) -> None:
        waiting = self.cycle is None or self.cycle.response_complete
        if waiting and not self.transport.is_closing():
            log.info(
                "closing a connection from %s: no request headers within %g s",
                self.client,
                self.header_timeout_s,
            )
            self.transport.close()


def header_deadline_protocol(header_timeout_s: float) -> type[HeaderDeadlineH11]:
    """The HTTP protocol class for ``uvicorn.Config(http=...)``."""
    return type("HeaderDeadlineH11", (HeaderDeadlineH11,), {"header_timeout_s": header_timeout_s})
