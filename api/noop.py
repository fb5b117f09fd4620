"""A no-op twin of the command endpoints, for the benchmark's framework ceiling.

Same server, workers, routing, dependencies, request models and JSON responses as the real commands,
but no database: what it reaches is the most any command endpoint of this stack can reach. Mounted only
when ``LOCKLEDGER_BENCH_NOOP`` is true; never in production.
"""

from __future__ import annotations

import itertools
import json
from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from api.commands import Holder, lease_owner
from api.dependencies import ResourcePath, command_context
from api.models import AcquireRequest, ReleaseRequest, RenewRequest
from service.lock_service import CommandContext

router = APIRouter(prefix="/v1/noop", tags=["benchmark"], include_in_schema=False)

Context = Annotated[CommandContext, Depends(command_context)]
_tokens = itertools.count(1)


def _lease(resource: str, owner: str, token: int, ttl_ms: int, status: int) -> Response:
    expires_at = datetime.now(UTC) + timedelta(milliseconds=ttl_ms)
    body = {
        "resource": resource,
        "owner": owner,
        "fencing_token": token,
        "expires_at": expires_at.isoformat(),
        "ttl_ms": ttl_ms,
    }
    return Response(json.dumps(body), status_code=status, media_type="application/json")


@router.post("/{resource}/acquire", status_code=201)
async def acquire(resource: ResourcePath, body: AcquireRequest, caller: Holder, ctx: Context) -> Response:
    return _lease(resource, lease_owner(body.owner, caller), next(_tokens), body.ttl_ms or 30_000, 201)


@router.post("/{resource}/renew")
async def renew(resource: ResourcePath, body: RenewRequest, caller: Holder, ctx: Context) -> Response:
    owner = lease_owner(body.owner, caller)
    return _lease(resource, owner, body.fencing_token, body.ttl_ms or 30_000, 200)


@router.post("/{resource}/release")
async def release(resource: ResourcePath, body: ReleaseRequest, caller: Holder, ctx: Context) -> Response:
    payload = {
        "resource": resource,
        "owner": lease_owner(body.owner, caller),
        "fencing_token": body.fencing_token,
        "released": True,
    }
    return Response(json.dumps(payload), media_type="application/json")
