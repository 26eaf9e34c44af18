"""Connection bounds below the handlers: idle connections are limited apart from busy ones.

A connection is *idle* while it has not sent a complete request head: just opened, sending
its headers slowly, or kept alive between two requests. It is *busy* from its request head
to the end of its response. The two are bounded separately, so sockets that send nothing
cost their sender, never the clients being served:

- idle connections: at most ``max_idle_connections``; one more closes the *oldest* idle
  one (a flood of silent sockets closes its own sockets first; a client that sends its
  request as it connects is idle for microseconds), and each has ``header_read_timeout_s``
  to finish its request head (uvicorn itself has no such deadline);
- busy connections (requests being served): at most ``max_connections``; one more is
  answered at once with a 503 in the OpenAI error shape (:class:`RequestLimit`).

uvicorn's own ``limit_concurrency`` is not used: it counts idle connections with busy ones
and answers its own plain-text 503. A request uvicorn cannot parse is answered 400 in the
OpenAI error shape too, so no refusal is plain text.
"""

from __future__ import annotations

import json
import logging
import time

from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("zeal.serve")

__all__ = ["RequestLimit", "guarded_protocol"]


def _error_body(message: str, type_: str, code: str | None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


class _RateLimitedLog:
    """One log line per ``every`` seconds with the count of events since the last line."""

    def __init__(self, every: float = 10.0) -> None:
        self.every, self.count, self.last = every, 0, float("-inf")

    def __call__(self, fmt: str, *args) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= self.every:
            log.warning(fmt, self.count, *args)
            self.count, self.last = 0, now


class IdleBook:
    """The idle connections of one server, oldest first; closes the oldest beyond ``cap``."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.idle: dict = {}  # protocol -> None, in the order they became idle
        self._log = _RateLimitedLog()

    def add(self, proto) -> None:
        self.idle.pop(proto, None)
        self.idle[proto] = None
        while len(self.idle) > self.cap:
            oldest = next(iter(self.idle))
            del self.idle[oldest]
            oldest.close_idle()
            self._log("closed %d connection(s) that had sent no complete request (over max_idle_connections %d)",
                      self.cap)

    def remove(self, proto) -> None:
        self.idle.pop(proto, None)


def guarded_protocol(header_timeout: float, max_idle: int) -> type:
    """uvicorn's h11 protocol with the idle bookkeeping above: a deadline on each request
    head (the clock starts when the connection opens and again when a response ends, and
    stops when a request's head is complete; the body has its own deadline in the
    handlers) and at most ``max_idle`` idle connections, oldest closed first. One class
    per server: its idle book is shared by that server's connections only."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    book = IdleBook(max_idle)

    class GuardedH11Protocol(H11Protocol):
        idle_book = book
        _header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self._in_request():
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to bytes that are no HTTP request, in the OpenAI error shape."""
            import h11

            body = _error_body(msg, "invalid_request_error", None)
            headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                       (b"content-length", str(len(body)).encode())]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

        def close_idle(self) -> None:
            """Close this connection (the idle book's choice); nothing is in flight on it."""
            self._disarm()
            if not self.transport.is_closing():
                self.transport.close()

        def _in_request(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            if not self.transport.is_closing() and not self._in_request():
                self._header_timer = self.loop.call_later(header_timeout, self._expire)
                book.add(self)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            book.remove(self)

        def _expire(self) -> None:
            self._header_timer = None
            book.remove(self)
            if not self._in_request() and not self.transport.is_closing():
                log.info("closing a connection that sent no complete request headers within %s s", header_timeout)
                self.transport.close()

    return GuardedH11Protocol


class RequestLimit:
    """ASGI middleware: at most ``max_requests`` requests served at once; one more is answered
    at once with 503 (``Retry-After: 1``, ``Connection: close``) in the OpenAI error shape."""

    def __init__(self, app: ASGIApp, max_requests: int) -> None:
        self.app, self.max_requests = app, max_requests
        self.active = 0
        self._log = _RateLimitedLog()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.active >= self.max_requests:
            self._log("refused %d request(s): %d already being served (max_connections)", self.max_requests)
            body = _error_body(f"the server is serving its limit of {self.max_requests} requests at once "
                               "(max_connections); retry later", "server_error", "too_many_requests")
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                    (b"retry-after", b"1"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1
