"""RFC 9457 problem+json responses with a stable machine-readable ``code``.

Every failure a client can see goes through here, so no input, however malformed, yields an HTML page or
an unstructured 500.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match
from starlette.staticfiles import StaticFiles

from api.auth import document_security
from api.paths import route_path
from domain.errors import DomainError, InvalidCommand, LeaseExpired, LockHeld, NotHolder
from domain.reservation import ReservationHeld
from domain.resource import RESOURCE_RULE
from domain.shared_lock import LimitMismatch, SharedLockHeld
from domain.timestamps import format_timestamp
from projections.archived import Archived
from service.database_guard import UNREACHABLE
from service.errors import Conflict, Forbidden, IdempotencyKeyReused, ServiceError, Unauthorized, Unavailable

log = structlog.get_logger("lockledger.api")

PROBLEM_JSON = "application/problem+json"

_TITLES = {
    "bad_request": "Bad request",
    "lock_held": "Lock held",
    "not_holder": "Not the holder",
    "lease_expired": "Lease expired",
    "limit_mismatch": "Limit mismatch",
    "idempotency_key_reused": "Idempotency-Key reused",
    "validation_error": "Validation error",
    "unsupported_media_type": "Unsupported media type",
    "not_found": "Not found",
    "method_not_allowed": "Method not allowed",
    "unauthorized": "Unauthorized",
    "forbidden": "Forbidden",
    "unavailable": "Service unavailable",
    "archived": "Archived",
    "internal_error": "Internal error",
}

_STATUS = {
    LockHeld: 409,
    NotHolder: 409,
    LeaseExpired: 410,
    InvalidCommand: 422,
    IdempotencyKeyReused: 422,
    Conflict: 409,
    Unauthorized: 401,
    Forbidden: 403,
    Unavailable: 503,
}


def _default(value: Any) -> Any:
    if isinstance(value, datetime):
        return format_timestamp(value)
    return str(value)


def problem(
    status: int,
    code: str,
    detail: str,
    *,
    instance: str | None = None,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> Response:
    body: dict[str, Any] = {
        "type": f"urn:lockledger:problem:{code}",
        "title": _TITLES.get(code, code.replace("_", " ").capitalize()),
        "status": status,
        "code": code,
        "detail": detail,
    }
    if instance:
        body["instance"] = instance
    body.update(extra)
    return Response(
        json.dumps(body, default=_default), status_code=status, media_type=PROBLEM_JSON, headers=headers
    )


def install(app: FastAPI) -> None:
    """Register the handlers that turn every exception into problem+json."""

    @app.exception_handler(DomainError)
    async def domain_error(request: Request, error: DomainError) -> Response:
        extra: dict[str, Any] = {"resource": error.resource}
        if isinstance(error, LockHeld):
            extra.update(holder=error.holder, expires_at=error.expires_at, fencing_token=error.fencing_token)
        if isinstance(error, ReservationHeld):
            extra["conflicts"] = [
                {"resource": held.resource, "holder": held.holder, "expires_at": held.expires_at,
                 "fencing_token": held.fencing_token}
                for held in error.conflicts
            ]  # fmt: skip
        if isinstance(error, SharedLockHeld):
            extra["conflicts"] = [
                {"mode": grant.mode, "owner": grant.owner, "fencing_token": grant.fencing_token,
                 "expires_at": grant.expires_at}
                for grant in error.conflicts
            ]  # fmt: skip
        if isinstance(error, LimitMismatch):
            extra["limit"] = error.limit
        if isinstance(error, LeaseExpired):
            extra.update(expired_at=error.expired_at)
        return problem(
            _STATUS.get(type(error), 409), error.code, error.detail, instance=request.url.path, **extra
        )

    @app.exception_handler(Archived)
    async def archived(request: Request, error: Archived) -> Response:
        archives = [
            {
                "partition": s.partition,
                "from": s.start,
                "to": s.end,
                "file": s.file_name,
                "restore": s.restore,
            }
            for s in error.spans
        ]
        return problem(410, "archived", str(error), instance=request.url.path, archives=archives)

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, error: ServiceError) -> Response:
        headers: dict[str, str] | None = None
        if isinstance(error, Unavailable):
            headers = {"Retry-After": str(error.retry_after_s)}
        elif isinstance(error, Unauthorized):
            headers = {"WWW-Authenticate": 'Bearer realm="lockledger"'}
        return problem(
            _STATUS.get(type(error), 409),
            error.code,
            error.detail,
            instance=request.url.path,
            headers=headers,
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> Response:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
            for e in error.errors()
        ]
        detail = (
            "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors)
            or "invalid request"
        )
        return problem(422, "validation_error", detail, instance=request.url.path, errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> Response:
        code = _HTTP_CODES.get(
            error.status_code, "validation_error" if 400 <= error.status_code < 500 else "internal_error"
        )
        # FastAPI answers 400 for a body it cannot decode at all (e.g. invalid UTF-8) but 422 for one that
        # is not JSON; the contract has one answer for malformed input: 422 validation_error.
        status = 422 if code == "validation_error" and error.status_code == 400 else error.status_code
        headers = getattr(error, "headers", None)
        if status == 405:
            # Starlette names the methods of the first route whose path matched; RFC 9110 wants all of them.
            # The documentation's assets are a mounted app of their own, which serves GET and HEAD.
            static = isinstance(request.scope.get("endpoint"), StaticFiles)
            headers = {**(headers or {}), "Allow": "GET, HEAD" if static else _allowed_methods(request)}
        detail = str(error.detail)
        if status == 404 and "endpoint" not in request.scope:  # no route matched at all
            detail = _no_route(request)
        return problem(status, code, detail, instance=request.url.path, headers=headers)

    async def database_unavailable(request: Request, error: Exception) -> Response:
        log.warning("database unavailable", error=repr(error), path=request.url.path)
        return problem(
            503,
            "unavailable",
            "the database is not answering; retry shortly",
            instance=request.url.path,
            headers={"Retry-After": "1"},
        )

    for error_type in UNREACHABLE:
        app.add_exception_handler(error_type, database_unavailable)

    @app.exception_handler(ClientDisconnect)
    async def client_disconnected(request: Request, error: ClientDisconnect) -> Response:
        """A client that hangs up before its request body arrived: expected on any network, so one line,
        not an error with a traceback. The answer goes nowhere (the connection is gone)."""
        log.info("client hung up before sending its request body", path=request.url.path, reason="hangup")
        return problem(400, "bad_request", "the client hung up mid-request", instance=request.url.path)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> Response:
        # One traceback, rendered off the event loop and without locals (service/logs.py), which also
        # drops the second one uvicorn logs for the same exception ("Exception in ASGI application").
        log.exception("unhandled error", path=request.url.path)
        return problem(500, "internal_error", "an unexpected error occurred", instance=request.url.path)


_HTTP_CODES = {
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    415: "unsupported_media_type",
}

_LOCKS = "/v1/locks/"


def _no_route(request: Request) -> str:
    """Why no endpoint is at this path, as far as the path tells: most often a resource id with a
    ``/`` in it (sent as is or as ``%2F``, which the server decodes to the same path), which can never
    be one segment; or a trailing slash, which no path here has (the server does not redirect: a
    redirected POST is not retried by every client, and ``/v1/locks/%2F`` must not list every lock)."""
    path = request.url.path
    routed = route_path(request.scope)  # the path without a proxy's root path
    if routed.startswith(_LOCKS):
        return (
            f"no endpoint at {path}: a lock's endpoints are /v1/locks/{{resource}} and "
            "/v1/locks/{resource}/acquire, renew, release, force-release or history, where a resource id "
            f"is exactly one path segment: {RESOURCE_RULE} (an encoded %2F is a '/' too)"
        )
    if routed.endswith("/") and routed != "/":
        scope = {**request.scope, "path": request.scope["path"][:-1]}
        if any(route.matches(scope)[0] is not Match.NONE for route in request.app.router.routes):
            return f"no endpoint at {path}; paths here have no trailing slash: {path[:-1]}"
    return f"no endpoint at {path}; the API's endpoints are listed at /docs and /openapi.json"


def _allowed_methods(request: Request) -> str:
    """Every method some route serves at this path, asked of the router itself (FastAPI nests included
    routers, so the routes' own method sets are not at hand)."""
    allowed = []
    for method in ("DELETE", "GET", "PATCH", "POST", "PUT"):
        scope = {**request.scope, "method": method}
        if any(route.matches(scope)[0] is Match.FULL for route in request.app.router.routes):
            allowed.append(method)
    return ", ".join(allowed)


def document(app: FastAPI) -> None:
    """Make the OpenAPI say what the handlers above do: every validation error (422) is problem+json,
    not FastAPI's default ``HTTPValidationError`` JSON, every operation may answer 400 ``bad_request``
    (a repeated header), 431 and 503 ``unavailable``, and every operation behind a token may answer 401
    and 403."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        document_security(schema)
        problem_schema = {
            "type": "object",
            "required": ["type", "title", "status", "code", "detail"],
            "properties": {
                "type": {"type": "string"},
                "title": {"type": "string"},
                "status": {"type": "integer"},
                "code": {"type": "string"},
                "detail": {"type": "string"},
                "instance": {"type": "string"},
            },
        }
        schema.setdefault("components", {}).setdefault("schemas", {})["ProblemDetails"] = problem_schema
        reference = {"application/problem+json": {"schema": {"$ref": "#/components/schemas/ProblemDetails"}}}
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                responses = operation.setdefault("responses", {})
                answers = [("422", "Validation error"), ("503", "Service unavailable")]
                # api/limits.py: any request may carry too many header bytes, or repeat a header the
                # service reads once; only a body can be too big.
                answers.append(("400", "A header the service reads once (e.g. Authorization) is repeated"))
                answers.append(("431", "Request headers too large"))
                if "requestBody" in operation:
                    answers.append(("413", "Request body too large"))
                    answers.append(("415", "The body is not sent as JSON (Content-Type: application/json)"))
                if operation.get("security"):
                    answers += [
                        ("401", "No valid API token"),
                        ("403", "The token's role does not allow this"),
                    ]
                for status, description in answers:
                    responses[status] = {"description": description, "content": reference}
                for status, response in responses.items():
                    if status.startswith(("4", "5")):
                        response["content"] = reference
        from api.limits import document_limits  # imported here: api.limits imports this module

        document_limits(schema, app.state.settings)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
