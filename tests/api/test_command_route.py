"""CommandRoute serves lock commands and saga transitions alike, only endpoints of the shape it knows
(anything else is refused when the app is built, never served differently from what the OpenAPI says),
and documents exactly the headers its caller reads."""

from __future__ import annotations

from typing import Annotated, Any

import httpx
import pytest
from fastapi import APIRouter, Depends, FastAPI, Header
from fastapi.responses import JSONResponse, Response

from api import commands, sagas
from api.command_route import LOCK_COMMAND_HEADERS, CommandCall, CommandRoute
from api.commands import Holder
from api.dependencies import ResourcePath
from api.models import AcquireRequest, ReleaseRequest
from tests.api.routing import bench_app


def test_an_endpoint_of_the_command_shape_is_accepted() -> None:
    router = APIRouter(route_class=CommandRoute)

    @router.post("/{resource}/acquire")
    async def acquire(resource: ResourcePath, body: AcquireRequest, call: Holder) -> Response:
        return Response()

    @router.post("/{resource}/heartbeat")
    async def without_body(resource: ResourcePath, call: Holder) -> Response:
        return Response()

    assert [route.path for route in router.routes] == ["/{resource}/acquire", "/{resource}/heartbeat"]  # type: ignore[attr-defined]


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

    async def two_bodies(
        resource: ResourcePath, body: AcquireRequest, other: ReleaseRequest, call: Holder
    ) -> Response:
        return Response()

    for endpoint in (extra_header, no_caller, other_dependency, two_bodies):
        with pytest.raises(TypeError, match="a CommandRoute endpoint takes"):
            router.add_api_route("/{resource}/acquire", endpoint, methods=["POST"])


def test_lock_commands_and_saga_transitions_are_served_by_it() -> None:
    """Every POST under /v1/locks and /v1/sagas; none of the reads."""
    routes = [*commands.router.routes, *sagas.commands.routes, *sagas.router.routes]
    posts = [route for route in routes if "POST" in getattr(route, "methods", ())]
    assert len(posts) == 7 + 10  # acquire, renew, release, handoff, accept, decline, force-release
    assert all(isinstance(route, CommandRoute) for route in posts)
    assert not any(isinstance(route, CommandRoute) for route in sagas.router.routes)


def _header_names(document: dict[str, Any], path: str) -> list[str]:
    parameters = document["paths"][path]["post"].get("parameters", [])
    return [p["name"] for p in parameters if p["in"] == "header"]


def test_the_openapi_documents_the_headers_each_caller_reads() -> None:
    document = bench_app().openapi()
    lock_headers = [header.name for header in LOCK_COMMAND_HEADERS]
    for verb in ("acquire", "renew", "release", "force-release"):
        assert _header_names(document, f"/v1/locks/{{resource}}/{verb}") == lock_headers
    saga_headers = ["Idempotency-Key", "X-Correlation-ID", "X-Causation-ID"]
    assert _header_names(document, "/v1/sagas") == saga_headers
    assert _header_names(document, "/v1/sagas/{saga_id}/steps/{step}/complete") == saga_headers
    idempotency_key = document["paths"]["/v1/sagas"]["post"]["parameters"][0]
    assert idempotency_key["schema"] == {"type": "string", "minLength": 1, "maxLength": 255}


async def test_the_caller_is_a_real_dependency_the_plain_router_can_solve() -> None:
    """The caller is no placeholder: on a plain FastAPI route it gives the same call it gives the route."""
    app = FastAPI()
    app.state.authenticator = None  # dev mode: the anonymous admin
    app.state.lock_service = None

    @app.post("/{resource}/acquire")
    async def acquire(resource: ResourcePath, call: Holder) -> JSONResponse:
        assert isinstance(call, CommandCall)
        return JSONResponse({"principal": call.context.principal, "key": call.context.idempotency_key})

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        answer = await client.post("/zone:A3/acquire", headers={"Idempotency-Key": "k1"})
    assert answer.json() == {"principal": "anonymous", "key": "k1"}


@pytest.mark.parametrize("opentelemetry", [False, True])
async def test_served_alike_with_or_without_opentelemetry(opentelemetry: bool) -> None:
    """Past the router (the fast path) or through it (OpenTelemetry on), a lock command and a saga
    transition are validated by the same route, every invalid part at once."""
    app = bench_app(opentelemetry=opentelemetry)
    app.state.authenticator = None  # dev mode: the anonymous admin; not started, so no database
    app.state.lock_service = None
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        lock = await client.post("/v1/locks/a b/acquire", json={"ttl_ms": "x"}, headers={"X-Saga-ID": ""})
        saga = await client.post("/v1/sagas/a b/steps/c d/fail", json={}, headers={"Idempotency-Key": ""})
        lock_ok = await client.post("/v1/locks/a b/acquire", json={"ttl_ms": "x"})
        saga_ok = await client.post("/v1/sagas/s1/steps/c d/fail", json={})
    assert {r.status_code for r in (lock, saga, lock_ok, saga_ok)} == {422}
    assert [e["loc"] for e in lock.json()["errors"]] == [["header", "X-Saga-ID"]]
    assert [e["loc"] for e in saga.json()["errors"]] == [["header", "Idempotency-Key"]]
    assert [e["loc"] for e in lock_ok.json()["errors"]] == [["path", "resource"], ["body", "ttl_ms"]]
    assert [e["loc"] for e in saga_ok.json()["errors"]] == [["path", "step"], ["body", "reason"]]
