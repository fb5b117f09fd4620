"""A no-op twin of the command endpoints, for the benchmark's framework ceiling.

Same server, workers, routing, route class (``CommandRoute``: authentication, headers, request models)
and JSON responses as the real commands, but no database: what it reaches is the most any command
endpoint of this stack can reach. Mounted only by the benchmark's own app (``bench.app``); never in
production.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.routing import Match
from starlette.types import Scope

from api.command_route import CommandRoute
from api.commands import Holder, lease_owner
from api.dependencies import ResourcePath
from api.models import AcquireRequest, Lease, Released, ReleaseRequest, RenewRequest
from api.paths import route_path
from service.outcomes import Granted
from service.outcomes import Released as ReleasedOutcome


class _OwnPathsOnly(APIRouter):
    """A router that turns away a path outside its prefix at once, instead of trying each of its routes.

    The twin is mounted first, where the commands are when it is absent, so that it is matched as cheaply
    as they are in production; this keeps it from charging the real commands, matched after it in a
    benchmark, for trying its routes too (about 10 µs per request on the bench machine).
    """

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        # The path as the routes see it (a proxy's root path removed), by the function they match with.
        if not route_path(scope).startswith(self.prefix + "/"):
            return Match.NONE, {}
        return super().matches(scope)


router = _OwnPathsOnly(
    prefix="/v1/noop", tags=["benchmark"], include_in_schema=False, route_class=CommandRoute
)

_tokens = itertools.count(1)


def _lease(resource: str, owner: str, token: int, ttl_ms: int, status: int) -> Response:
    expires_at = datetime.now(UTC) + timedelta(milliseconds=ttl_ms)
    lease = Granted(resource, owner, token, expires_at, ttl_ms)
    return _render(Lease, lease, status)


def _render(model: type[BaseModel], outcome: object, status: int = 200) -> Response:
    """The outcome rendered as the real commands render theirs (api/commands.py)."""
    body = model.model_validate(outcome, from_attributes=True).model_dump_json()
    return Response(body, status_code=status, media_type="application/json")


@router.post("/{resource}/acquire", status_code=201)
async def acquire(resource: ResourcePath, body: AcquireRequest, call: Holder) -> Response:
    return _lease(resource, lease_owner(body.owner, call.caller), next(_tokens), body.ttl_ms or 30_000, 201)


@router.post("/{resource}/renew")
async def renew(resource: ResourcePath, body: RenewRequest, call: Holder) -> Response:
    owner = lease_owner(body.owner, call.caller)
    return _lease(resource, owner, body.fencing_token, body.ttl_ms or 30_000, 200)


@router.post("/{resource}/release")
async def release(resource: ResourcePath, body: ReleaseRequest, call: Holder) -> Response:
    owner = lease_owner(body.owner, call.caller)
    return _render(Released, ReleasedOutcome(resource, owner, body.fencing_token))
