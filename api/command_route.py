"""The command endpoints' request path: FastAPI documents them, this route serves them.

An agent's acquire, heartbeat and release are most of the traffic, and FastAPI's general machinery was
most of their cost: solving a dependency tree per request, validating each header and path parameter
through its own pydantic field, re-inspecting the endpoint's signature. Measured: about three quarters of
the no-op twin's server time per request (docs/decisions/0014-command-route.md). A command endpoint needs
far less, always the same: authenticate the caller, read its optional headers, refuse query parameters
(it has none), check the resource segment, validate one JSON body. ``CommandRoute`` does exactly that, in
that order (so a request without credentials is 401 before its body is looked at, as with FastAPI's
dependencies), and then calls the endpoint. Its handler is reached past the router by
``api/fast_path.py``.

The endpoint is still declared the FastAPI way, ``(resource: ResourcePath, body: SomeRequest, call:
Holder)``, so the OpenAPI at ``/docs`` (path pattern, body schema, the headers ``CommandCaller``
declares, the bearer scheme) is generated as before, and validation errors have the shape FastAPI gives
them (``loc``, ``msg``, ``type``; turned into problem+json by ``api/problems.py``). A route whose endpoint
has any other shape is refused when the app is built, not served differently. Verified with FastAPI
0.165 (pinned in pyproject.toml); ``tests/api/test_fast_path.py`` compares its answers with FastAPI's own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Annotated, Any

from fastapi import Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from api.auth import authorize
from api.request_checks import declared_query, header_text, require_json, unknown_query_errors
from domain.access import Action, Principal
from domain.resource import RESOURCE_MAX_LENGTH, RESOURCE_RULE, is_valid_resource
from domain.saga import SAGA_ID_MAX_LENGTH, SAGA_ID_PATTERN, is_valid_saga_id
from domain.value import value
from service.idempotency import MAX_KEY_LENGTH
from service.lock_service import CommandContext, LockService

_TRACE_MAX_LENGTH = 200  # X-Correlation-ID, X-Causation-ID

# The headers every command and saga transition reads, declared once for both.
IdempotencyKeyHeader = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=MAX_KEY_LENGTH,
        description="Retry-safe key: the same key and request return the stored response.",
    ),
]
CorrelationIdHeader = Annotated[str | None, Header(alias="X-Correlation-ID", max_length=_TRACE_MAX_LENGTH)]
CausationIdHeader = Annotated[str | None, Header(alias="X-Causation-ID", max_length=_TRACE_MAX_LENGTH)]


@value
class CommandCall:
    """Who sends a command, the context it ties into, the service that runs it, and whether the client
    has gone (asked before a waiting acquire tries again)."""

    caller: Principal
    context: CommandContext
    service: LockService
    disconnected: Callable[[], Awaitable[bool]]


class CommandCaller:
    """The dependency of every command endpoint: the caller, allowed ``action``, and the command context.

    FastAPI reads ``__call__``'s signature for the OpenAPI (the headers and their limits); ``CommandRoute``
    calls ``from_request``, which reads the same headers by hand and applies the same limits.
    """

    def __init__(self, action: Action) -> None:
        self.action = action

    async def __call__(
        self,
        request: Request,
        idempotency_key: IdempotencyKeyHeader = None,
        correlation_id: CorrelationIdHeader = None,
        causation_id: CausationIdHeader = None,
        saga_id: Annotated[
            str | None,
            Header(
                alias="X-Saga-ID",
                pattern=SAGA_ID_PATTERN,
                max_length=SAGA_ID_MAX_LENGTH,
                description="The saga this command is taken within; kept in the events' metadata.",
            ),
        ] = None,
        saga_step: Annotated[
            str | None,
            Header(
                alias="X-Saga-Step",
                pattern=SAGA_ID_PATTERN,
                max_length=SAGA_ID_MAX_LENGTH,
                description="The saga step this command is taken for.",
            ),
        ] = None,
    ) -> CommandCall:
        raise NotImplementedError("served by CommandRoute, which calls from_request")

    async def from_request(self, request: Request) -> CommandCall:
        """Authenticate and authorize first (401/403 before anything else is looked at), then the headers.

        The Idempotency-Key (and the trace ids) are opaque text, compared and stored as sent. Their bytes
        are decoded as UTF-8, so a key with non-ASCII characters is stored, shown in the events'
        metadata and matched on replay as the characters the client sent; bytes that are not UTF-8 are
        a 422. The IETF draft describes the key as a Structured Field String (quoted, printable ASCII);
        like other servers this one does not insist on that form, and never unquotes a key.
        """
        caller = await authorize(request, self.action)
        errors: list[dict[str, Any]] = []
        idempotency_key = _text_header(request, "Idempotency-Key", errors)
        correlation_id = _text_header(request, "X-Correlation-ID", errors)
        causation_id = _text_header(request, "X-Causation-ID", errors)
        saga_id = _saga_header(request, "X-Saga-ID", errors)
        saga_step = _saga_header(request, "X-Saga-Step", errors)
        errors += [
            *_length_errors("Idempotency-Key", idempotency_key, 1, MAX_KEY_LENGTH),
            *_length_errors("X-Correlation-ID", correlation_id, 0, _TRACE_MAX_LENGTH),
            *_length_errors("X-Causation-ID", causation_id, 0, _TRACE_MAX_LENGTH),
        ]
        if errors:
            raise RequestValidationError(errors)
        # Idempotency-Keys are scoped to the principal: one agent's key never replays another's response.
        context = CommandContext(
            principal=caller.name,
            idempotency_key=idempotency_key,
            correlation_id=correlation_id,
            causation_id=causation_id,
            saga_id=saga_id,
            saga_step=saga_step,
        )
        return CommandCall(caller, context, request.app.state.lock_service, request.is_disconnected)


class CommandRoute(APIRoute):
    """Serves an endpoint ``(resource, body, call)`` without FastAPI's per-request dependency solving."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint, body_model, caller = self._command_shape()
        accepted = declared_query(self.dependant)

        async def handle(request: Request) -> Response:
            call = await caller.from_request(request)
            errors = unknown_query_errors(request, accepted) if request.scope.get("query_string") else []
            resource: str = request.path_params["resource"]
            if not is_valid_resource(resource):
                errors.append(_resource_error(resource))
            body = await _body(request, body_model, errors)
            if errors:
                raise RequestValidationError(errors)
            response: Response = await endpoint(resource=resource, body=body, call=call)
            return response

        return handle

    def _command_shape(self) -> tuple[Callable[..., Any], type[BaseModel], CommandCaller]:
        dependant = self.dependant
        body_types = [field.field_info.annotation for field in dependant.body_params]
        callers = [sub.call for sub in dependant.dependencies if isinstance(sub.call, CommandCaller)]
        shape_ok = (
            [field.name for field in dependant.path_params] == ["resource"]
            and len(body_types) == 1
            and isinstance(body_types[0], type)
            and issubclass(body_types[0], BaseModel)
            and len(callers) == 1
            and len(dependant.dependencies) == 1
            and not (dependant.query_params or dependant.header_params or dependant.cookie_params)
        )
        if not shape_ok:
            raise TypeError(f"{self.path}: a CommandRoute endpoint takes (resource, body, call) only")
        assert isinstance(body_types[0], type)
        return self.endpoint, body_types[0], callers[0]


async def _body(request: Request, model: type[BaseModel], errors: list[dict[str, Any]]) -> BaseModel | None:
    """The validated body; a body that is not declared JSON is a 415 (``require_json``), whatever else
    is wrong with the request."""
    raw = await request.body()
    if not raw:
        msg = "Field required: a JSON object, sent with Content-Type: application/json"
        errors.append({"type": "missing", "loc": ("body",), "msg": msg, "input": None})
        return None
    require_json(request)
    try:
        return model.model_validate_json(raw)
    except ValidationError as invalid:
        for error in invalid.errors(include_url=False):
            errors.append({**error, "loc": ("body", *error["loc"])})
        return None


def _resource_error(resource: str) -> dict[str, Any]:
    if not resource:
        return {
            "type": "string_too_short",
            "loc": ("path", "resource"),
            "msg": "String should have at least 1 character",
        }
    if len(resource) > RESOURCE_MAX_LENGTH:
        msg = f"String should have at most {RESOURCE_MAX_LENGTH} characters"
        return {"type": "string_too_long", "loc": ("path", "resource"), "msg": msg}
    msg = f"String should be a resource id: {RESOURCE_RULE}"
    return {"type": "string_pattern_mismatch", "loc": ("path", "resource"), "msg": msg}


def _text_header(request: Request, header: str, errors: list[dict[str, Any]]) -> str | None:
    try:
        return header_text(request, header)
    except UnicodeDecodeError:
        msg = "Header value should be UTF-8 text"
        errors.append({"type": "string_unicode", "loc": ("header", header), "msg": msg})
        return None


def _saga_header(request: Request, header: str, errors: list[dict[str, Any]]) -> str | None:
    """``X-Saga-ID`` or ``X-Saga-Step``: a saga id or step name (``domain/saga.py``), or absent."""
    value = _text_header(request, header, errors)
    if value is None or is_valid_saga_id(value):
        return value
    if not value or len(value) > SAGA_ID_MAX_LENGTH:
        errors += _length_errors(header, value, 1, SAGA_ID_MAX_LENGTH)
    else:
        msg = f"String should match pattern '{SAGA_ID_PATTERN}'"
        errors.append({"type": "string_pattern_mismatch", "loc": ("header", header), "msg": msg})
    return None


def _length_errors(header: str, value: str | None, low: int, high: int) -> list[dict[str, Any]]:
    if value is None:
        return []
    if len(value) < low:
        return [
            {
                "type": "string_too_short",
                "loc": ("header", header),
                "msg": f"String should have at least {low} character",
            }
        ]
    if len(value) > high:
        return [
            {
                "type": "string_too_long",
                "loc": ("header", header),
                "msg": f"String should have at most {high} characters",
            }
        ]
    return []
