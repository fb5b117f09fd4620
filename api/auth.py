"""Authentication and authorization as FastAPI dependencies.

``current_principal`` turns the ``Authorization: Bearer`` header into a :class:`Principal` (cached per
request by FastAPI, so a route asking twice pays once); ``require(action)`` adds the role check. In dev
mode there is no authenticator and every caller is the anonymous admin, so the quick start works
without tokens.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from domain.access import DEV_PRINCIPAL, Action, Principal, allows, roles_allowed
from service.authenticator import Authenticator
from service.errors import Forbidden, Unauthorized

bearer = HTTPBearer(
    auto_error=False,  # our own 401 problem+json instead of FastAPI's 403 {"detail": ...}
    description="An API token from `lockledger tokens create --name NAME --role ROLE`.",
)


async def current_principal(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> Principal:
    authenticator: Authenticator | None = request.app.state.authenticator
    if authenticator is None:
        return DEV_PRINCIPAL
    if credentials is None:
        raise Unauthorized("send an API token: Authorization: Bearer <token>")
    principal = await authenticator.authenticate(credentials.credentials)
    if principal is None:
        raise Unauthorized("the API token is unknown or revoked")
    return principal


def require(action: Action) -> Callable[[Principal], Awaitable[Principal]]:
    """A dependency that lets only roles allowed ``action`` through (403 otherwise)."""

    async def check(principal: Annotated[Principal, Depends(current_principal)]) -> Principal:
        if not allows(principal.role, action):
            needed = ", ".join(roles_allowed(action))
            raise Forbidden(f"{principal.name} has role {principal.role}; {action} needs one of: {needed}")
        return principal

    return check
