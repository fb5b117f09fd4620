"""The log digest over HTTP, for investigators to take and keep outside the system (eventstore/digest.py).

Read through the read pool (a replica can serve it), for the investigator and admin roles. Verifying a
kept digest is ``lockledger verify --digest``, run by someone who does not have to trust this server.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from pydantic import BaseModel, Field

from api.auth import require
from api.request_checks import StrictRoute
from domain.access import Action
from eventstore import digest

router = APIRouter(prefix="/v1/audit", tags=["audit"], route_class=StrictRoute)


class LogDigest(BaseModel):
    position: int = Field(description="The global position the digest covers the log up to.")
    events: int = Field(description="Events at or before `position`.")
    streams: int = Field(description="Streams with an event at or before `position`.")
    digest: str = Field(
        description="`lldg1:<position>:<events>:<streams>:<sha256 hex>`; keep it outside the system and "
        "check it later with `lockledger verify --digest`."
    )


@router.get(
    "/digest",
    response_model=LogDigest,
    responses={404: {"description": "no event at that position yet: it is beyond the newest"}},
    dependencies=[Depends(require(Action.READ_HISTORY))],
)
async def log_digest(
    request: Request,
    position: Annotated[
        int | None, Query(ge=0, lt=2**63, description="Cover the log up to here (default: the newest).")
    ] = None,
) -> LogDigest:
    """A digest of every event up to `position`: it proves later that none of them was altered, inserted
    or removed, whole streams and streams' newest events included."""
    async with request.app.state.read_pool.acquire() as conn:
        try:
            found = await digest.compute_digest(conn, position)
        except digest.PositionBeyondLog as error:
            raise HTTPException(404, str(error)) from error
    return LogDigest(position=found.position, events=found.events, streams=found.streams, digest=str(found))
