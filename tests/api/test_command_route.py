"""CommandRoute serves only endpoints of the shape it knows; anything else is refused when the app is
built, never served differently from what the OpenAPI says."""

from __future__ import annotations

from typing import Annotated

import pytest
from fastapi import APIRouter, Depends, Header
from fastapi.responses import Response

from api.command_route import CommandRoute
from api.commands import Holder
from api.dependencies import ResourcePath
from api.models import AcquireRequest


def test_an_endpoint_of_the_command_shape_is_accepted() -> None:
    router = APIRouter(route_class=CommandRoute)

    @router.post("/{resource}/acquire")
    async def acquire(resource: ResourcePath, body: AcquireRequest, call: Holder) -> Response:
        return Response()

    assert [route.path for route in router.routes] == ["/{resource}/acquire"]  # type: ignore[attr-defined]


def test_an_endpoint_with_another_shape_is_refused_at_build_time() -> None:
    router = APIRouter(route_class=CommandRoute)

    async def extra_header(
        resource: ResourcePath, body: AcquireRequest, call: Holder, x_flag: Annotated[str, Header()]
    ) -> Response:
        return Response()

    async def no_caller(resource: ResourcePath, body: AcquireRequest) -> Response:
        return Response()

    async def other_dependency(
        resource: ResourcePath, body: AcquireRequest, call: Holder, other: Annotated[int, Depends(lambda: 1)]
    ) -> Response:
        return Response()

    for endpoint in (extra_header, no_caller, other_dependency):
        with pytest.raises(TypeError, match="takes \\(resource, body, call\\) only"):
            router.add_api_route("/{resource}/acquire", endpoint, methods=["POST"])
