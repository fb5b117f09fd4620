"""The one way commands are served, locks and sagas alike: FastAPI declares them, ``CommandRoute`` serves.

An agent's acquire, heartbeat and release are most of the traffic, and FastAPI's general machinery was
most of their cost: solving a dependency tree per request, validating each header through its own
pydantic field, re-inspecting the endpoint's signature (docs/decisions/0014-command-route.md). A command
endpoint needs far less, always the same: authenticate and authorize the caller, read the headers its
caller declares, refuse query parameters (it has none), validate its path parameters and one JSON body.
``CommandRoute`` does exactly that, in that order (so a request without credentials is 401 before its
body is looked at, as with FastAPI's dependencies), and then calls the endpoint. Without OpenTelemetry
its handler is reached past the router by ``api/fast_path.py``; with it, through the router.

An endpoint is declared once, the FastAPI way: its path parameters (``Path`` constraints), at most one
body (a model, or a model or None), the ``CommandCaller`` dependency (``call: Holder``), and, if it needs
the app, the ``Request``. FastAPI documents it from that signature; the headers the caller reads are
documented from the caller's own ``CommandHeader`` declarations, which are what ``CommandCaller``
validates, so the OpenAPI cannot disagree with what is served. Validation errors have the shape FastAPI
gives them (``loc``, ``msg``, ``type``; turned into problem+json by ``api/problems.py``). A route whose
endpoint has any other shape is refused when the app is built, not served differently. Verified with
FastAPI 0.165 (pinned in pyproject.toml); ``tests/api/test_fast_path.py`` compares its answers with the
router's.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from api.auth import authorize
from api.request_checks import header_text, require_json, unknown_query_errors
from domain.access import Action, Principal
from domain.saga import SAGA_ID_MAX_LENGTH, SAGA_ID_PATTERN
from domain.value import value
from service.idempotency import MAX_KEY_LENGTH
from service.lock_service import CommandContext, LockService

_TRACE_MAX_LENGTH = 200  # X-Correlation-ID, X-Causation-ID


@dataclass(frozen=True, slots=True)
class CommandHeader:
    """An optional header a command reads: validated by ``CommandCaller`` and documented from here.

    Header values are opaque text, compared and stored as sent. Their bytes are decoded as UTF-8, so a key
    with non-ASCII characters is stored, shown in the events' metadata and matched on replay as the
    characters the client sent; bytes that are not UTF-8 are a 422. The IETF draft describes the
    Idempotency-Key as a Structured Field String (quoted, printable ASCII); like other servers this one
    does not insist on that form, and never unquotes a key.
    """

    name: str
    max_length: int
    min_length: int = 0
    pattern: str | None = None
    description: str | None = None

    def read(self, request: Request, errors: list[dict[str, Any]]) -> str | None:
        """The header's text, or None when absent or invalid (the reason appended to ``errors``)."""
        loc = ("header", self.name)
        try:
            text = header_text(request, self.name)
        except UnicodeDecodeError:
            errors.append({"type": "string_unicode", "loc": loc, "msg": "Header value should be UTF-8 text"})
            return None
        if text is None:
            return None
        if len(text) < self.min_length:
            msg = f"String should have at least {self.min_length} character"
            errors.append({"type": "string_too_short", "loc": loc, "msg": msg})
        elif len(text) > self.max_length:
            msg = f"String should have at most {self.max_length} characters"
            errors.append({"type": "string_too_long", "loc": loc, "msg": msg})
        elif self.pattern is not None and re.match(self.pattern, text) is None:
            msg = f"String should match pattern '{self.pattern}'"
            errors.append({"type": "string_pattern_mismatch", "loc": loc, "msg": msg})
        else:
            return text
        return None

    def openapi(self) -> dict[str, Any]:
        """The header as an OpenAPI parameter."""
        schema: dict[str, Any] = {"type": "string", "maxLength": self.max_length}
        if self.min_length:
            schema["minLength"] = self.min_length
        if self.pattern is not None:
            schema["pattern"] = self.pattern
        parameter: dict[str, Any] = {"name": self.name, "in": "header", "required": False, "schema": schema}
        if self.description is not None:
            parameter["description"] = self.description
        return parameter


IDEMPOTENCY_KEY = CommandHeader(
    "Idempotency-Key",
    MAX_KEY_LENGTH,
    min_length=1,
    description="Retry-safe key: the same key and request return the stored response.",
)
CORRELATION_ID = CommandHeader("X-Correlation-ID", _TRACE_MAX_LENGTH)
CAUSATION_ID = CommandHeader("X-Causation-ID", _TRACE_MAX_LENGTH)
SAGA_ID = CommandHeader(
    "X-Saga-ID",
    SAGA_ID_MAX_LENGTH,
    min_length=1,
    pattern=SAGA_ID_PATTERN,
    description="The saga this command is taken within; kept in the events' metadata.",
)
SAGA_STEP = CommandHeader(
    "X-Saga-Step",
    SAGA_ID_MAX_LENGTH,
    min_length=1,
    pattern=SAGA_ID_PATTERN,
    description="The saga step this command is taken for.",
)
# What every command reads; a lock command taken within a saga also names the saga and its step.
COMMAND_HEADERS = (IDEMPOTENCY_KEY, CORRELATION_ID, CAUSATION_ID)
LOCK_COMMAND_HEADERS = (*COMMAND_HEADERS, SAGA_ID, SAGA_STEP)


@value
class CommandCall:
    """Who sends a command, the context it ties into, the service that runs it, and whether the client
    has gone (asked before a waiting acquire tries again)."""

    caller: Principal
    context: CommandContext
    service: LockService
    disconnected: Callable[[], Awaitable[bool]]


class CommandCaller:
    """The dependency of every command endpoint: the caller, allowed ``action``, and the command context
    read from ``headers``. ``CommandRoute`` calls it with the request, before anything else."""

    def __init__(self, action: Action, headers: tuple[CommandHeader, ...] = COMMAND_HEADERS) -> None:
        self.action = action
        self.headers = headers

    async def __call__(self, request: Request) -> CommandCall:
        """Authenticate and authorize first (401/403 before anything else is looked at), then the headers.
        Idempotency-Keys are scoped to the principal: one agent's key never replays another's response."""
        caller = await authorize(request, self.action)
        errors: list[dict[str, Any]] = []
        sent = {header.name: header.read(request, errors) for header in self.headers}
        if errors:
            raise RequestValidationError(errors)
        context = CommandContext(
            principal=caller.name,
            idempotency_key=sent.get(IDEMPOTENCY_KEY.name),
            correlation_id=sent.get(CORRELATION_ID.name),
            causation_id=sent.get(CAUSATION_ID.name),
            saga_id=sent.get(SAGA_ID.name),
            saga_step=sent.get(SAGA_STEP.name),
        )
        return CommandCall(caller, context, request.app.state.lock_service, request.is_disconnected)


@dataclass(frozen=True, slots=True)
class _Body:
    """The endpoint's body parameter: its name, its validator, and whether it may be left out."""

    name: str
    validate_json: Callable[[bytes], Any]
    required: bool


class CommandRoute(APIRoute):
    """Serves an endpoint ``(path parameters..., [body], call[, request])`` without FastAPI's per-request
    dependency solving; documents the headers its ``CommandCaller`` reads."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        extra = dict(self.openapi_extra or {})
        declared = list(extra.get("parameters", ()))
        named = {parameter.get("name") for parameter in declared}  # a copied route has them already
        headers = [header.openapi() for header in self._caller().headers if header.name not in named]
        self.openapi_extra = {**extra, "parameters": [*declared, *headers]}

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint = self.endpoint
        caller = self._caller()
        call_name = self.dependant.dependencies[0].name
        assert call_name is not None  # a parameter's, not the route's own dependencies=[...]
        request_name = self.dependant.request_param_name
        path_checks = {
            field.name: _validator(field.field_info).validate_python for field in self.dependant.path_params
        }
        body = self._body()

        async def handle(request: Request) -> Response:
            arguments: dict[str, Any] = {call_name: await caller(request)}
            if request_name is not None:
                arguments[request_name] = request
            errors = unknown_query_errors(request, ()) if request.scope.get("query_string") else []
            sent = request.path_params
            for name, check in path_checks.items():
                try:
                    arguments[name] = check(sent[name])
                except ValidationError as invalid:
                    errors += _located(invalid, ("path", name))
            if body is not None:
                arguments[body.name] = await _read_body(request, body, errors)
            if errors:
                raise RequestValidationError(errors)
            response: Response = await endpoint(**arguments)
            return response

        return handle

    def _caller(self) -> CommandCaller:
        dependant = self.dependant
        callers = [sub.call for sub in dependant.dependencies if isinstance(sub.call, CommandCaller)]
        shape_ok = (
            len(callers) == 1
            and len(dependant.dependencies) == 1
            and len(dependant.body_params) <= 1
            and not (dependant.query_params or dependant.header_params or dependant.cookie_params)
        )
        if not shape_ok:
            raise TypeError(
                f"{self.path}: a CommandRoute endpoint takes (path parameters, a body, call, request) only"
            )
        return callers[0]

    def _body(self) -> _Body | None:
        if not self.dependant.body_params:
            return None
        field = self.dependant.body_params[0]
        validator = _validator(field.field_info)
        return _Body(field.name, validator.validate_json, field.field_info.is_required())


class _Validator(Protocol):
    """What is used of pydantic-core's validator."""

    def validate_python(self, value: Any, /) -> Any: ...

    def validate_json(self, data: bytes, /) -> Any: ...


def _validator(info: FieldInfo) -> _Validator:
    """pydantic-core's validator for a declared parameter: its type with its constraints (lengths,
    pattern); called directly, without ``TypeAdapter``'s per-call wrapper."""
    declared: Any = Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation
    return TypeAdapter(declared).validator


async def _read_body(request: Request, body: _Body, errors: list[dict[str, Any]]) -> Any:
    """The validated body (None for an optional body left out); a body that is not declared JSON is a
    415 (``require_json``), whatever else is wrong with the request."""
    raw = await request.body()
    if not raw:
        if body.required:
            msg = "Field required: a JSON object, sent with Content-Type: application/json"
            errors.append({"type": "missing", "loc": ("body",), "msg": msg, "input": None})
        return None
    require_json(request)
    try:
        return body.validate_json(raw)
    except ValidationError as invalid:
        errors += _located(invalid, ("body",))
        return None


def _located(invalid: ValidationError, where: tuple[str, ...]) -> list[dict[str, Any]]:
    return [{**error, "loc": (*where, *error["loc"])} for error in invalid.errors(include_url=False)]
