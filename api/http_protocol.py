"""The HTTP/1.1 connection: uvicorn's httptools protocol with the guards a server facing the open network
needs, in one place because each reaches into uvicorn's internals.

uvicorn bounds neither how long a client may take to send a request head or body nor how many connections
a process holds open, so slow clients that never finish a request (slowloris) can take every file
descriptor and with them the health check. ``GuardedHttpToolsProtocol`` adds, per connection:

- **head deadline**: a request head must be complete ``http_head_timeout_s`` after it began (for a new
  connection: after it was accepted, so a silent one is closed too); otherwise 408 ``request_timeout``.
- **body deadline**: its body must be complete ``http_body_timeout_s`` after the head; otherwise 408.
- **head size cap**: httptools holds an unfinished head in memory without limit; once the reads that
  leave it unfinished pass uvicorn's ``h11_max_incomplete_event_size`` (64 KiB if unset), 431
  ``headers_too_large`` and close. The exact, configurable limit stays with ``api.limits.RequestLimits``.
- **connection cap**: at most ``http_max_connections`` per process, kept below the open-file limit. A
  connection beyond it displaces the one that has waited longest without a complete request (an
  unfinished head first, then an unfinished body, then an idle keep-alive connection) and only when every
  connection holds a request being served is it refused itself, with 503 ``unavailable`` and Retry-After.
- **write deadline**: a response the client does not take: once the connection's write buffer passes
  the transport's high-water mark, the client must take enough of it to bring it below the low-water
  mark within ``http_write_timeout_s``; otherwise the connection is aborted (``SO_LINGER`` 0, so no
  kernel buffer is kept for it either) and one line with ``reason="write_timeout"`` and the path is
  logged. This is what ends a change-feed reader that stopped reading (docs/semantics.md): its window is
  full, so no ``overflow`` event could reach it, and the app's send waits until the connection is gone.
- **drain**: a graceful shutdown first ends every waiting acquire (503, the client retries elsewhere)
  instead of waiting out ``LOCKLEDGER_MAX_WAIT_MS`` (the lifespan puts the drain under ``DRAIN``).
- **problem+json 400**: a request httptools cannot parse gets ``bad_request`` as problem+json, not
  uvicorn's plain text.

Timers are armed only for a request that does not arrive in one read (a new connection's first head
aside), so a request sent whole costs a few flag checks. Each closing is counted in
``lockledger_http_connections_closed_total{reason}``; timeouts and closings at the cap are also logged, at
most once per ``LOG_WINDOW_S`` per reason with the count since the previous line, so that an attack does
not become a flood of log lines.

Verified against uvicorn 0.55.0 (httptools 0.9.0). The parts of ``HttpToolsProtocol`` this relies on
(methods overridden, attributes read) are listed in ``UVICORN_CONTRACT`` and checked by
``tests/api/test_http_protocol.py``. Select it with ``http="api.http_protocol:GuardedHttpToolsProtocol"``.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import struct
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, ClassVar, Final, TypeAlias

import structlog
from prometheus_client import Counter
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from api.problems import PROBLEM_JSON, problem
from service.config import Settings

log = structlog.get_logger("lockledger.http")

DRAIN = "lockledger.drain"  # the lifespan state's key: a callable that ends every wait

LOG_WINDOW_S: Final = 10.0
DEFAULT_HEAD_CAP: Final = 64 * 1024
# File descriptors a process keeps beyond its client connections: the database pools, its listening
# socket, logs and the event loop's own, plus headroom for connections accepted in one burst before any
# is displaced or refused.
FD_RESERVE_MIN: Final = 64
UNLIMITED_CONNECTIONS: Final = 16_384  # the default when the open-file limit is unlimited

# Methods of uvicorn's HttpToolsProtocol overridden here, and attributes of it (and of its
# RequestResponseCycle) read or written here: the assumptions an upgrade of uvicorn may break.
UVICORN_CONTRACT: Final = {
    "methods": (
        "connection_made",
        "connection_lost",
        "data_received",
        "on_message_begin",
        "on_headers_complete",
        "on_message_complete",
        "on_response_complete",
        "send_400_response",
        "shutdown",
        "handle_websocket_upgrade",
        "pause_writing",
        "resume_writing",
    ),
    "protocol_attributes": (
        "config",
        "loop",
        "transport",
        "cycle",
        "pipeline",
        "connections",
        "server_state",
        "app_state",
        "client",
    ),
    "cycle_attributes": ("response_started", "response_complete", "disconnected", "message_event"),
}

CLOSED = Counter(
    "lockledger_http_connections_closed_total",
    "Client connections the server closed before or instead of serving a request, by reason",
    ["reason"],
)


@dataclass(frozen=True, slots=True)
class ServingLimits:
    head_timeout_s: float
    body_timeout_s: float
    max_connections: int
    write_timeout_s: float = 30.0


def open_file_limit() -> int | None:
    """This process's soft limit on open files (``ulimit -n``); None when unlimited or unknown."""
    if sys.platform == "win32":
        return None
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def connection_cap(settings: Settings, file_limit: int | None) -> int:
    """The connections one process may hold: the configured maximum, but never so many that the open-file
    limit is reached (then ``accept`` fails, and new clients, health checks included, are dropped or left
    waiting)."""
    if file_limit is None:
        return settings.http_max_connections or UNLIMITED_CONNECTIONS
    reserve = settings.pool_max_size + settings.read_pool_max_size + max(FD_RESERVE_MIN, file_limit // 8)
    allowed = max(1, file_limit - reserve)
    if settings.http_max_connections is None:
        return allowed
    if settings.http_max_connections > allowed:
        log.warning(
            "LOCKLEDGER_HTTP_MAX_CONNECTIONS is above what the open-file limit allows; raise `ulimit -n`",
            configured=settings.http_max_connections,
            serving_at_most=allowed,
            open_file_limit=file_limit,
        )
        return allowed
    return settings.http_max_connections


@functools.cache
def serving_limits() -> ServingLimits:
    """The limits from the ``LOCKLEDGER_*`` environment, read once per process (as ``create_app`` reads
    the rest of the settings; every worker reads its own)."""
    settings = Settings()
    return ServingLimits(
        head_timeout_s=settings.http_head_timeout_s,
        body_timeout_s=settings.http_body_timeout_s,
        max_connections=connection_cap(settings, open_file_limit()),
        write_timeout_s=settings.http_write_timeout_s,
    )


@dataclass(frozen=True, slots=True)
class _Answer:
    """A problem+json response that closes the connection, written by the protocol itself."""

    status: int
    tail: bytes  # the headers that follow the server's default ones, the blank line, the body

    def wire(self, default_headers: list[tuple[bytes, bytes]]) -> bytes:
        head = [b"HTTP/1.1 %d %s\r\n" % (self.status, HTTPStatus(self.status).phrase.encode())]
        head += [name + b": " + value + b"\r\n" for name, value in default_headers]
        return b"".join(head) + self.tail


def _answer(status: int, code: str, detail: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> _Answer:
    body = bytes(problem(status, code, detail).body)
    lines = [
        b"content-type: " + PROBLEM_JSON.encode(),
        b"content-length: %d" % len(body),
        b"connection: close",
        *(name + b": " + value for name, value in headers),
    ]
    return _Answer(status, b"\r\n".join(lines) + b"\r\n\r\n" + body)


def _unavailable(detail: str) -> _Answer:
    return _answer(503, "unavailable", detail, ((b"retry-after", b"1"),))


_REFUSED = _unavailable("the server holds too many connections; retry shortly")
_DISPLACED = _unavailable("the server holds too many connections and this one had no complete request")
_BAD_REQUEST = _answer(400, "bad_request", "the request is not well-formed HTTP/1.1")


@dataclass(slots=True)
class _Tally:
    """Closings of one kind: the first is logged at once, the rest as one line per window with a count."""

    event: str
    reason: str
    pending: int = 0
    next_at: float = 0.0
    flush: asyncio.TimerHandle | None = None

    def add(self, loop: asyncio.AbstractEventLoop, **fields: Any) -> None:
        CLOSED.labels(self.reason).inc()
        now = loop.time()
        if now >= self.next_at:
            log.warning(self.event, reason=self.reason, count=1, **fields)
            self.next_at = now + LOG_WINDOW_S
            return
        self.pending += 1
        if self.flush is None:
            self.flush = loop.call_at(self.next_at, self._report, loop)

    def _report(self, loop: asyncio.AbstractEventLoop) -> None:
        self.flush = None
        if self.pending:
            log.warning(self.event, reason=self.reason, count=self.pending, window_s=LOG_WINDOW_S)
            self.pending = 0
            self.next_at = loop.time() + LOG_WINDOW_S


# Connections in one state, insertion-ordered: the one that has waited longest comes first.
Registry: TypeAlias = dict["GuardedHttpToolsProtocol", None]


@dataclass(slots=True)
class _Serving:
    """What the connections of one uvicorn server share: limits, who may be displaced, log tallies."""

    limits: ServingLimits
    heads: Registry = field(default_factory=dict)  # waiting for a request head
    bodies: Registry = field(default_factory=dict)  # waiting for a request body
    idle: Registry = field(default_factory=dict)  # keep-alive, between requests
    head_timeouts: _Tally = field(
        default_factory=lambda: _Tally("request head not received in time; answered 408", "head_timeout")
    )
    body_timeouts: _Tally = field(
        default_factory=lambda: _Tally("request body not received in time; answered 408", "body_timeout")
    )
    displaced: _Tally = field(
        default_factory=lambda: _Tally(
            "connection cap reached; closed a connection without a complete request", "displaced"
        )
    )
    refused: _Tally = field(
        default_factory=lambda: _Tally(
            "connection cap reached and every connection busy; refused a new one with 503", "refused"
        )
    )
    write_timeouts: _Tally = field(
        default_factory=lambda: _Tally(
            "client did not take the response in time; connection aborted", "write_timeout"
        )
    )


_SERVING: weakref.WeakKeyDictionary[ServerState, _Serving] = weakref.WeakKeyDictionary()

_HEAD, _BODY = 0, 1


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with deadlines, caps, drain and problem+json errors (module doc)."""

    limits: ClassVar[ServingLimits | None] = None  # None: from the environment (``serving_limits``)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        serving = _SERVING.get(self.server_state)
        if serving is None:
            serving = _SERVING[self.server_state] = _Serving(self.limits or serving_limits())
        self._serving = serving
        self._head_cap = self.config.h11_max_incomplete_event_size or DEFAULT_HEAD_CAP
        self._head_open = False  # a request has begun and its head has not ended
        self._head_began_in_read = False
        self._head_bytes = 0
        self._body_open = False  # a head has ended and its body has not
        self._idle = False  # in ``serving.idle``
        self._timer: asyncio.TimerHandle | None = None
        self._phase = _HEAD  # what the timer waits for (and which registry holds this connection)
        self._write_timer: asyncio.TimerHandle | None = None  # armed while writing is paused

    # --- connection ---------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        serving = self._serving
        if len(self.connections) > serving.limits.max_connections and not self._displace_another():
            serving.refused.add(
                self.loop, client=self._client(), max_connections=serving.limits.max_connections
            )
            self._close(_REFUSED)
            return
        self._arm(_HEAD)  # a connection that never sends a byte is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        super().connection_lost(exc)

    def handle_websocket_upgrade(self) -> None:
        self._forget()  # the connection is the WebSocket protocol's from here on
        super().handle_websocket_upgrade()

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown tells every connection; the first one to hear ends the waits."""
        drain: Callable[[], None] | None = self.app_state.get(DRAIN)
        if drain is not None:
            drain()
        super().shutdown()

    # --- reading ------------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._idle:
            self._serving.idle.pop(self, None)
            self._idle = False
        self._head_began_in_read = False
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self._head_open:
            if not self._head_began_in_read:
                self._head_bytes += len(data)  # all of this read belongs to the unfinished head
                if self._head_bytes > self._head_cap:
                    CLOSED.labels("headers_too_large").inc()
                    detail = f"the request headers take more than {self._head_cap} bytes"
                    self._close(_answer(431, "headers_too_large", detail))
                    return
            if self._timer is None:
                self._arm(_HEAD)
        elif self._body_open and self._timer is None:
            self._arm(_BODY)

    def on_message_begin(self) -> None:
        self._head_open = self._head_began_in_read = True
        self._head_bytes = 0
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._head_open = False
        self._body_open = True
        if self._timer is not None:
            self._disarm()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._body_open = False
        if self._timer is not None and self._phase == _BODY:
            self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        cycle = self.cycle
        if (
            not self._head_open
            and not self._body_open
            and (cycle is None or cycle.response_complete)
            and not self.transport.is_closing()
        ):
            self._idle = True
            self._serving.idle[self] = None

    def send_400_response(self, msg: str) -> None:
        """A request httptools cannot parse (bad request line, control characters in a header, ...)."""
        CLOSED.labels("bad_request").inc()
        self._close(_BAD_REQUEST)

    # --- writing ------------------------------------------------------------------------------------

    def pause_writing(self) -> None:
        """The write buffer passed the high-water mark: the client has that long to take it."""
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(
                self._serving.limits.write_timeout_s, self._write_timed_out
            )

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_write_timer()

    def _stop_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_timed_out(self) -> None:
        self._write_timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        self._serving.write_timeouts.add(
            self.loop,
            client=self._client(),
            path=cycle.scope["path"] if cycle is not None else None,
            timeout_s=self._serving.limits.write_timeout_s,
        )
        sock = self.transport.get_extra_info("socket")
        if sock is not None:  # a reset, not an orderly close that would wait for the client to read
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()  # connection_lost tells the app that the client is gone

    # --- deadlines and the cap ----------------------------------------------------------------------

    def _arm(self, phase: int) -> None:
        limits = self._serving.limits
        self._phase = phase
        timeout = limits.head_timeout_s if phase == _HEAD else limits.body_timeout_s
        self._timer = self.loop.call_later(timeout, self._timed_out)
        self._registry(phase)[self] = None

    def _disarm(self) -> None:
        assert self._timer is not None
        self._timer.cancel()
        self._timer = None
        self._registry(self._phase).pop(self, None)

    def _forget(self) -> None:
        self._stop_write_timer()
        if self._timer is not None:
            self._disarm()
        if self._idle:
            self._serving.idle.pop(self, None)
            self._idle = False

    def _registry(self, phase: int) -> Registry:
        return self._serving.heads if phase == _HEAD else self._serving.bodies

    def _timed_out(self) -> None:
        self._timer = None
        self._registry(self._phase).pop(self, None)
        if self.transport.is_closing():
            return
        limits = self._serving.limits
        if self._phase == _HEAD:
            self._serving.head_timeouts.add(self.loop, client=self._client(), timeout_s=limits.head_timeout_s)
            detail = f"the request head did not arrive within {limits.head_timeout_s:g} s"
        else:
            self._serving.body_timeouts.add(self.loop, client=self._client(), timeout_s=limits.body_timeout_s)
            detail = f"the request body did not arrive within {limits.body_timeout_s:g} s"
        self._close(_answer(408, "request_timeout", detail))

    def _displace_another(self) -> bool:
        """Close the connection that has waited longest without a complete request; False if none has."""
        serving = self._serving
        for registry, answer in (
            (serving.heads, _DISPLACED),
            (serving.bodies, _DISPLACED),
            (serving.idle, None),  # nothing asked: closed as a keep-alive timeout would
        ):
            if registry:
                victim = next(iter(registry))
                serving.displaced.add(
                    self.loop, client=victim._client(), max_connections=serving.limits.max_connections
                )
                victim._close(answer)
                return True
        return False

    def _close(self, answer: _Answer | None) -> None:
        """Close the connection, first sending ``answer`` if it can only be read as the answer to the
        request now being received."""
        self._forget()
        if answer is not None and self._claim_response():
            self.transport.write(answer.wire(self.server_state.default_headers))
        self.transport.close()

    def _claim_response(self) -> bool:
        """Whether a response written now answers the request being received: no earlier request is being
        answered, and this one's app has not begun its own response. Its app is then told that the client
        is gone, so that it stops waiting for the body and its response is dropped."""
        cycle = self.cycle
        if cycle is None:
            return True
        if self.pipeline:  # requests queued behind one being answered
            return False
        if not self._body_open:
            return bool(cycle.response_complete)
        if cycle.response_started:
            return False
        cycle.disconnected = True
        cycle.message_event.set()
        return True

    def _client(self) -> str | None:
        return f"{self.client[0]}:{self.client[1]}" if self.client else None
