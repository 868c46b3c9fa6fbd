"""Connections the server keeps open: a deadline for each request's headers, a bound on open connections, the
descriptor limit raised at start, and accept errors logged once a minute instead of once per try.

Without these, a client that opens connections and never finishes a request's headers (no API key needed: the key
is a header) holds a file descriptor each for ever; a few hundred exhaust them, ``/health`` stops answering and
asyncio logs ``socket.accept() out of system resource`` on every try. Here:

- headers must arrive within ``header_timeout_s`` of the connection opening or of the request's first byte
  (then 408, or a plain close where nothing came at all); the time of that first byte goes to the app
  (``request.state.first_byte``), whose ``--timeout`` counts from it, and which bounds the body's time itself;
- at most ``max_connections`` are open: a new one beyond takes the place of the connection waiting longest for a
  request's bytes (headers or body), or is answered 503 where every connection is busy with an answer;
- the soft ``RLIMIT_NOFILE`` is raised to the hard limit, and the bound (and the accept backlog) kept below what it
  leaves.

Imported only when a server starts (it subclasses uvicorn's h11 protocol).
"""

from __future__ import annotations

import logging
import os
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0  # a request's headers, from the connection or the request's first byte
DESCRIPTORS_KEPT = 64  # descriptors left for everything but connections (model files, threads, logs)
ACCEPT_ERROR = "socket.accept() out of system resource"


def raise_descriptor_limit() -> int | None:
    """Raise this process's soft limit of open files to its hard limit; return the soft limit (None: unknown)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= hard:
        return min(soft, hard) if soft != resource.RLIM_INFINITY else hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        return soft
    return hard


def open_descriptors() -> int:
    """Descriptors this process has open now (0 where the system does not say)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def connection_limits(requested: int) -> tuple[int, int]:
    """(open connections at most, the listen backlog): ``requested`` connections, or fewer where the descriptor limit
    (raised first) leaves fewer after those open now. asyncio accepts up to a backlog of connections per turn of its
    loop before the protocol sees any (and closes a replaced one a turn later), so room for four backlogs is kept
    beyond the bound: accept itself never runs out of descriptors."""
    limit = raise_descriptor_limit()
    if limit is None:
        return requested, 2048
    room = limit - open_descriptors() - DESCRIPTORS_KEPT
    backlog = min(2048, max(8, room // 8))
    return max(1, min(requested, room - 4 * backlog)), backlog


class OncePerMinute(logging.Filter):
    """Lets asyncio's accept error through once a minute: at the descriptor limit it is raised on every try."""

    def __init__(self):
        super().__init__()
        self.last = -float("inf")

    def filter(self, record: logging.LogRecord) -> bool:
        if ACCEPT_ERROR not in record.getMessage():
            return True
        now = time.monotonic()
        if now - self.last < 60:
            return False
        self.last = now
        return True


def quiet_accept_errors() -> None:
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, OncePerMinute) for f in logger.filters):
        logger.addFilter(OncePerMinute())


def _plain_response(status: str, text: str, extra: str = "") -> bytes:
    body = text.encode()
    head = f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n{extra}"
    return head.encode() + f"content-length: {len(body)}\r\n\r\n".encode() + body


LATE_HEADERS = _plain_response("408 Request Timeout", "the request's headers did not arrive in time.\n")
FULL = _plain_response("503 Service Unavailable", "too many open connections; retry shortly.\n", "retry-after: 1\r\n")


def guarded_protocol(*, max_connections: int, header_timeout_s: float = HEADER_TIMEOUT_S) -> type:
    """uvicorn's h11 protocol with the header deadline and the connection bound (uvicorn.run(http=...))."""

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.opened = time.monotonic()
            self.first_byte: float | None = None
            self.header_timer = None
            if len(self.connections) > max_connections and not self._evict_one():
                transport.write(FULL)
                transport.close()
                return
            self.header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def waiting(self) -> bool:
            """True while no request is being answered here: between requests, or reading one's headers or body."""
            return self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing()

        def _evict_one(self) -> bool:
            """Close the connection that has waited longest for a request's bytes; False where none waits."""
            others = [p for p in self.connections if p is not self and isinstance(p, GuardedH11Protocol)]
            waiting = [p for p in others if p.waiting()]
            if not waiting:
                return False
            oldest = min(waiting, key=lambda p: p.opened)
            oldest.transport.close()  # its request, if the app has it, ends as a client that went away (499)
            return True

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE:
                if self.header_timer is None:  # a later request on a kept-alive connection
                    self.header_timer = self.loop.call_later(header_timeout_s, self._headers_late)
                if self.first_byte is None:
                    self.first_byte = time.monotonic()
            super().data_received(data)
            if self.header_timer is not None and self.conn.their_state is not h11.IDLE:  # the headers are in
                self.header_timer.cancel()
                self.header_timer = None
                if self.scope is not None and self.first_byte is not None:  # read by the app's --timeout
                    self.scope["state"]["first_byte"] = self.first_byte
                self.first_byte = None

        def _headers_late(self) -> None:
            self.header_timer = None
            if not self.transport.is_closing():
                if self.first_byte is not None:  # part of a request came: say why it is closed
                    self.transport.write(LATE_HEADERS)
                self.transport.close()

        def connection_lost(self, exc) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None
            super().connection_lost(exc)

    return GuardedH11Protocol
