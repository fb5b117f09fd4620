"""Authentication and authorization as one FastAPI dependency per route.

``require(action)`` turns the ``Authorization: Bearer`` header into a :class:`Principal` and checks its
role. It reads the header itself rather than through FastAPI's ``HTTPBearer`` and a chain of
sub-dependencies: each dependency level costs the hot path several microseconds of resolution, and this
runs on every command. The OpenAPI still documents the bearer scheme (``document_security``). In dev mode
there is no authenticator and every caller is the anonymous admin, so the quick start works without
tokens.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request

from domain.access import DEV_PRINCIPAL, Action, Principal, allows, roles_allowed
from service.authenticator import Authenticator
from service.errors import Forbidden, Unauthorized

SCHEME = "HTTPBearer"


async def authenticate(request: Request) -> Principal:
    authenticator: Authenticator | None = request.app.state.authenticator
    if authenticator is None:
        return DEV_PRINCIPAL
    scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("send an API token: Authorization: Bearer <token>")
    principal = await authenticator.authenticate(token.strip())
    if principal is None:
        raise Unauthorized("the API token is unknown or revoked")
    return principal


async def authorize(request: Request, action: Action) -> Principal:
    """The caller, if its role is allowed ``action`` (401 or 403 otherwise)."""
    principal = await authenticate(request)
    if not allows(principal.role, action):
        needed = ", ".join(roles_allowed(action))
        raise Forbidden(f"{principal.name} has role {principal.role}; {action} needs one of: {needed}")
    return principal


def require(action: Action) -> Callable[[Request], Awaitable[Principal]]:
    """A dependency that lets only callers allowed ``action`` through."""

    async def check(request: Request) -> Principal:
        return await authorize(request, action)

    return check


def document_security(schema: dict[str, Any]) -> None:
    """Declare the bearer scheme on every ``/v1`` operation, as ``HTTPBearer`` would have."""
    schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
    schemes[SCHEME] = {
        "type": "http",
        "scheme": "bearer",
        "description": "An API token from `lockledger tokens create --name NAME --role ROLE`.",
    }
    for path, operations in schema.get("paths", {}).items():
        if path.startswith("/v1/"):
            for operation in operations.values():
                operation["security"] = [{SCHEME: []}]
