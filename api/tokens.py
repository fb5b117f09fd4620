"""Token endpoints for admins: issue, list and revoke API tokens without database access.

The first admin token comes from `lockledger tokens create` (it needs the database); from then on an
admin can manage the fleet's tokens over HTTP. A token is in the response of its creation only.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from api.auth import require
from api.models import Timestamp
from api.request_checks import StrictRoute
from domain.access import Action, Role
from domain.resource import OWNER_PATTERN
from service import tokens
from service.authenticator import Authenticator
from service.errors import Conflict

router = APIRouter(
    prefix="/v1/tokens",
    tags=["tokens"],
    dependencies=[Depends(require(Action.MANAGE_TOKENS))],
    route_class=StrictRoute,
)

TokenName = Annotated[str, Path(pattern=OWNER_PATTERN, min_length=1, max_length=200)]


class TokenRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(
        pattern=OWNER_PATTERN,
        min_length=1,
        max_length=200,
        description="The principal (an agent's owner id).",
    )
    role: Role = Field(strict=False, description="agent, dashboard, investigator or admin.")  # JSON strings


class IssuedToken(BaseModel):
    name: str
    role: Role
    token: str = Field(description="Shown this once; only its SHA-256 is stored.")


class TokenEntry(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # read straight from service.tokens.TokenInfo
    id: int
    name: str
    role: Role
    created_at: Timestamp
    revoked_at: Timestamp | None


class TokenList(BaseModel):
    items: list[TokenEntry]


class Revoked(BaseModel):
    name: str
    revoked: int


@router.post("", status_code=201, response_model=IssuedToken, responses={409: {"description": "role clash"}})
async def issue(body: TokenRequest, request: Request) -> IssuedToken:
    """Issue a token. A name keeps its role for good: 409 `conflict` if it ever had tokens of another
    role, revoked or not (a token under the name would own that principal's leases and history)."""
    async with request.app.state.pool.acquire() as conn:
        try:
            token = await tokens.create(conn, body.name, body.role)
        except tokens.TokenError as error:
            raise Conflict(str(error)) from error
    return IssuedToken(name=body.name, role=body.role, token=token)


@router.get("", response_model=TokenList)
async def list_tokens(
    request: Request, include_revoked: Annotated[bool, Query(description="Also list revoked tokens.")] = False
) -> TokenList:
    """Every token's name, role and dates; never a token itself."""
    async with request.app.state.pool.acquire() as conn:
        rows = await tokens.list_all(conn, include_revoked=include_revoked)
    return TokenList(items=[TokenEntry.model_validate(t) for t in rows])


@router.delete("/{name}", response_model=Revoked, responses={404: {"description": "no live token"}})
async def revoke(name: TokenName, request: Request) -> Revoked:
    """Revoke every live token of `name`: at once in this server process, within the auth cache time
    (10 s) in the others."""
    async with request.app.state.pool.acquire() as conn:
        count = await tokens.revoke(conn, name)
    if count == 0:
        raise HTTPException(404, f"{name} has no live tokens")
    authenticator: Authenticator | None = request.app.state.authenticator
    if authenticator is not None:
        authenticator.forget_all()
    return Revoked(name=name, revoked=count)
