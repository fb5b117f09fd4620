"""Request-scoped inputs shared by the routers: the resource path segment and command context."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Path, Request

from api.auth import current_principal
from domain.access import Principal
from domain.resource import RESOURCE_PATTERN
from service.idempotency import MAX_KEY_LENGTH
from service.lock_service import CommandContext, LockService

ResourcePath = Annotated[
    str,
    Path(
        pattern=RESOURCE_PATTERN,
        min_length=1,
        max_length=200,
        description="Resource id, e.g. `pallet:42` or `zone:A3` (1-200 of `[A-Za-z0-9._:-]`, not only dots).",
    ),
]


async def command_context(
    principal: Annotated[Principal, Depends(current_principal)],
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            min_length=1,
            max_length=MAX_KEY_LENGTH,
            description="Retry-safe key: the same key and request return the stored response.",
        ),
    ] = None,
    correlation_id: Annotated[str | None, Header(alias="X-Correlation-ID", max_length=200)] = None,
    causation_id: Annotated[str | None, Header(alias="X-Causation-ID", max_length=200)] = None,
) -> CommandContext:
    # Idempotency-Keys are scoped to the principal: one agent's key never replays another's response.
    return CommandContext(
        principal=principal.name,
        idempotency_key=idempotency_key,
        correlation_id=correlation_id,
        causation_id=causation_id,
    )


async def lock_service(request: Request) -> LockService:
    service: LockService = request.app.state.lock_service
    return service
