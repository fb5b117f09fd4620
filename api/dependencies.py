"""Request-scoped inputs shared by the routers: the resource path segment and command context."""

from __future__ import annotations

from typing import Annotated

from fastapi import Header, Path, Request

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
    # The principal is the caller's (api/commands.py fills it in); keys are scoped to it.
    return CommandContext(
        idempotency_key=idempotency_key,
        correlation_id=correlation_id,
        causation_id=causation_id,
    )


async def lock_service(request: Request) -> LockService:
    service: LockService = request.app.state.lock_service
    return service
