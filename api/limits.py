"""Request size limits and repeated headers, enforced before any routing, parsing or database work.

A hostile or broken client must not make the server buffer megabytes of body or header: both are refused
with a problem+json answer (413 ``payload_too_large``, 431 ``headers_too_large``) like every other error.

A header the service reads as one value (``SINGLE_VALUE_HEADERS``) sent twice is 400 ``bad_request``
naming it. Starlette's ``request.headers.get`` returns the first, while a proxy, a log or an audit in
front of the service may read the last: two ``Authorization`` headers would let them disagree about who
the caller is, two ``Idempotency-Key`` headers about which retry this is. Refused here, where the raw
header list of every request passes (the command fast path, ``api/fast_path.py``, is inside this layer),
so no endpoint can forget it.

This is a pure ASGI middleware, not ``BaseHTTPMiddleware`` (which runs every request through an extra task
and memory stream, a cost on the hot path), and not Starlette's
``RequestBodyLimitMiddleware`` (it answers text/plain, builds a responder object per request and does not
look at headers). The common case costs one pass over the header list: a request that declares its
``Content-Length`` needs no counting, since the HTTP server never delivers more body than declared.

The memory guard in front of these limits, a cap on a request head still arriving, is in the HTTP
protocol (``api/http_protocol.py``).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.problems import problem
from service.config import Settings

# Each header line also carries ": " and CRLF on the wire; count them so the limit means wire bytes.
_LINE_OVERHEAD = 4

# The headers the service reads as one value, as the ASGI server hands them over (lower case), with the
# spelling the answer names them by. HTTP allows repeating only a header whose value is a list (RFC 9110
# section 5.3); Host twice is a 400 by RFC 9112 section 3.2, Content-Length twice a smuggling attempt.
SINGLE_VALUE_HEADERS: dict[bytes, str] = {
    name.lower().encode("latin-1"): name
    for name in (
        "Authorization",
        "Host",
        "Content-Type",
        "Content-Length",
        "Idempotency-Key",
        "X-Correlation-ID",
        "X-Causation-ID",
        "X-Saga-ID",
        "X-Saga-Step",
        "Last-Event-ID",
    )
}


class PayloadTooLarge(HTTPException):
    """Raised from ``receive`` once a streamed body passes the limit. An ``HTTPException`` so that
    FastAPI's body reader re-raises it as it is instead of turning it into a 400."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, _too_large_detail(limit))


class RequestLimits:
    """Refuse request bodies over ``max_body_bytes`` (413), header sections over ``max_header_bytes``
    (431) and a repeated single-value header (400)."""

    __slots__ = ("app", "max_body_bytes", "max_header_bytes")

    def __init__(self, app: ASGIApp, max_body_bytes: int, max_header_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header_bytes = 0
        content_length: bytes | None = None
        seen: set[bytes] = set()  # the single-value headers met so far
        repeated: bytes | None = None  # the first one met twice
        for name, value in scope["headers"]:
            header_bytes += len(name) + len(value) + _LINE_OVERHEAD
            if name in SINGLE_VALUE_HEADERS:
                if name in seen:
                    repeated = repeated or name
                seen.add(name)
                if name == b"content-length":
                    content_length = value
        if header_bytes > self.max_header_bytes:
            detail = f"the request headers take {header_bytes} bytes, more than {self.max_header_bytes}"
            await problem(431, "headers_too_large", detail, instance=scope["path"])(scope, receive, send)
            return
        if repeated is not None:
            answer = _repeated_header(SINGLE_VALUE_HEADERS[repeated], scope["path"])
            await answer(scope, receive, send)
            return
        if content_length is None or not content_length.isdigit():
            # Chunked, or no body at all (a malformed Content-Length never gets here: the server refuses it).
            await self.app(scope, _counted(receive, self.max_body_bytes), send)
            return
        if int(content_length) > self.max_body_bytes:
            # Answered before reading any of it; the server discards the rest and keeps the connection.
            detail = _too_large_detail(self.max_body_bytes)
            await problem(413, "payload_too_large", detail, instance=scope["path"])(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _repeated_header(header: str, path: str) -> Response:
    detail = (
        f"the request has more than one {header} header; send it once (a proxy or log reading the other "
        "one would disagree with this server about the request)"
    )
    return problem(400, "bad_request", detail, instance=path, header=header)


def _counted(receive: Receive, limit: int) -> Receive:
    received = 0

    async def counted_receive() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise PayloadTooLarge(limit)
        return message

    return counted_receive


def _too_large_detail(limit: int) -> str:
    return f"the request body is larger than {limit} bytes"


async def _payload_too_large(request: Request, error: Exception) -> Response:
    assert isinstance(error, PayloadTooLarge)
    return problem(413, "payload_too_large", error.detail, instance=request.url.path)


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_TTL_REQUESTS = (
    ("AcquireRequest", "ttl_ms"),
    ("RenewRequest", "ttl_ms"),
    ("AcceptRequest", "ttl_ms"),
    ("HandOffRequest", "accept_within_ms"),  # a handed-off lease is a lease of that length until accepted
    ("CreateSagaRequest", "lease_ms"),
    ("ReserveRequest", "ttl_ms"),
    ("RenewReservationRequest", "ttl_ms"),
    ("SharedAcquireRequest", "ttl_ms"),
    ("SharedRenewRequest", "ttl_ms"),
)


def document_limits(schema: dict[str, Any], settings: Settings) -> None:
    """Make the OpenAPI state the bounds exactly as the server enforces them, so that a client (or
    schemathesis) keeping to the document is never refused:

    - ``ttl_ms`` in the command bodies, a hand-off's ``accept_within_ms`` and a saga's ``lease_ms`` get the
      configured TTL bounds (settings,
      which the models cannot know); not in responses, whose leases may have been granted under other
      bounds;
    - numeric bounds become exact integers again: FastAPI's OpenAPI model holds them as floats, and
      ``2**62`` printed as ``4.611686018427388e+18`` reads back as 4611686018427388000, above the bound.
    """
    _exact_bounds(schema)
    bodies = schema["components"]["schemas"]
    for name, field in _TTL_REQUESTS:
        ttl = bodies[name]["properties"][field]
        for branch in ttl.get("anyOf", [ttl]):
            if branch.get("type") == "integer":
                branch.update(minimum=settings.ttl_min_ms, maximum=settings.ttl_max_ms)


def _exact_bounds(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _exact_bounds(item)
    elif isinstance(node, dict):
        for key in _BOUNDS:
            value = node.get(key)
            if isinstance(value, float) and value.is_integer():
                node[key] = int(value)
        for child in node.values():
            _exact_bounds(child)


def install_limits(app: FastAPI, settings: Settings) -> None:
    """Mount the middleware with the configured limits, and the handler for a streamed body's 413."""
    app.add_middleware(
        RequestLimits, max_body_bytes=settings.max_body_bytes, max_header_bytes=settings.max_header_bytes
    )
    app.add_exception_handler(PayloadTooLarge, _payload_too_large)
