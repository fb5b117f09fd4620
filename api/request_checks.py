"""Checks every endpoint makes of a request beyond its declared parameters.

- **Unknown query parameters are refused** (422 ``validation_error``), naming the parameter and the ones
  the endpoint accepts: a misspelt filter (``?owner=`` for ``?holder=``) would otherwise be ignored and
  the answer would silently cover everything. What an endpoint accepts is read from its declared query
  parameters (its own and its dependencies'), so no endpoint keeps a list of its own.
- **A body must be JSON and say so** (415 ``unsupported_media_type``): content without ``Content-Type:
  application/json`` (or any ``application/*+json``) is not parsed on a guess. RFC 9110 gives 415 to
  content in a format the resource does not take, whether the Content-Type named it or left it out.
- **Header text is UTF-8.** HTTP carries header values as bytes and Starlette decodes them as
  ISO-8859-1; a client that sends UTF-8 (the only encoding that a client library produces from a
  non-ASCII string) means its characters, so ``header_text`` decodes them as UTF-8.

``StrictRoute`` applies the first two to a FastAPI route as a dependency placed after the route's own
(so a request without credentials is still 401 before anything else is looked at); ``CommandRoute``
calls the same functions from its own request path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from email.message import Message
from typing import Any

from fastapi import Depends, Request
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.params import Depends as DependsParam
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException

JSON_REQUIRED = "the request body must be JSON, sent with Content-Type: application/json"


def declared_query(dependant: Dependant) -> tuple[str, ...]:
    """The query parameter names a route reads, through its whole dependency tree, in declared order
    (the fields of a query model count one by one)."""
    names: list[str] = []
    pending = [dependant]
    while pending:
        current = pending.pop(0)
        for field in current.query_params:
            annotation = field.field_info.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                names.extend(info.alias or name for name, info in annotation.model_fields.items())
            else:
                names.append(field.alias)
        pending.extend(current.dependencies)
    return tuple(dict.fromkeys(names))


def unknown_query_errors(request: Request, accepted: Sequence[str]) -> list[dict[str, Any]]:
    """One validation error per query parameter the endpoint does not read."""
    unknown = [name for name in dict.fromkeys(request.query_params.keys()) if name not in accepted]
    if not unknown:
        return []
    known = ", ".join(accepted) if accepted else "none"
    message = f"Unknown query parameter; this endpoint accepts: {known}"
    return [{"type": "extra_forbidden", "loc": ("query", name), "msg": message} for name in unknown]


def is_json(content_type: str) -> bool:
    """As FastAPI decides: ``application/json`` or any ``application/*+json``."""
    if content_type == "application/json" or content_type.startswith("application/json;"):
        return True
    message = Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def require_json(request: Request) -> None:
    """415 unless the request's Content-Type is JSON (a request without a body is not asked)."""
    content_type = request.headers.get("content-type")
    if content_type is not None and is_json(content_type):
        return
    sent = "no Content-Type" if content_type is None else f"Content-Type: {content_type[:100]}"
    raise HTTPException(415, f"{JSON_REQUIRED}; this request has {sent}")


def header_text(request: Request, name: str) -> str | None:
    """A header's value as the UTF-8 text the client sent; ``UnicodeDecodeError`` for other bytes."""
    value = request.headers.get(name)
    if value is None or value.isascii():
        return value
    return value.encode("latin-1").decode("utf-8")


class _QueryAndBodyCheck:
    """The dependency ``StrictRoute`` adds: bound to its route once the route knows its parameters."""

    def __init__(self) -> None:
        self.accepted: tuple[str, ...] = ()
        self.has_body = False

    async def __call__(self, request: Request) -> None:
        errors = unknown_query_errors(request, self.accepted)
        if errors:
            raise RequestValidationError(errors)
        if self.has_body and await request.body():
            require_json(request)


class StrictRoute(APIRoute):
    """An ``APIRoute`` that refuses unknown query parameters, and a body that is not JSON."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        check = _QueryAndBodyCheck()
        dependencies: list[DependsParam] = [*(kwargs.pop("dependencies", None) or ()), Depends(check)]
        super().__init__(path, endpoint, dependencies=dependencies, **kwargs)
        check.accepted = declared_query(self.dependant)
        check.has_body = self.body_field is not None
