"""The fast path serves exactly the requests the router would have given a command route, and answers
them as the router's stack would: same status, same headers, same body (problems included)."""

from __future__ import annotations

import json
from typing import Any
from unittest.mock import patch

import httpx
import pytest
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.routing import Match

from api import commands, sagas
from api.command_route import CommandRoute
from api.fast_path import CommandFastPath
from bench import noop
from tests.api.routing import bench_app, first_match, http_scope


def _app(**overrides: Any) -> FastAPI:
    app = bench_app(**overrides)
    # No lifespan, so no database: dev mode needs no authenticator, and the no-op twin no service.
    app.state.authenticator = None
    app.state.lock_service = None
    return app


def _fast_path(app: FastAPI) -> CommandFastPath | None:
    layer: Any = app.build_middleware_stack()
    while layer is not None:
        if isinstance(layer, CommandFastPath):
            return layer
        layer = getattr(layer, "app", None)
    return None


@pytest.fixture(scope="module")
def app() -> FastAPI:
    return _app()


@pytest.fixture(scope="module")
def fast_path(app: FastAPI) -> CommandFastPath:
    found = _fast_path(app)
    assert found is not None
    return found


def _routers_choice(app: FastAPI, scope: dict[str, Any]) -> Any:
    """The route FastAPI's router hands this request to (first full match, as Starlette's router picks),
    looking into the included router that matched; None for a 404 or 405."""
    picked = first_match(app.router.routes, scope)
    if picked is None or picked[1] != Match.FULL:
        return None
    route = app.router.routes[picked[0]]
    included: Any = getattr(route, "original_router", None)  # FastAPI's _IncludedRouter
    inner = None if included is None else first_match(included.routes, scope)
    return included.routes[inner[0]] if inner is not None and inner[1] == Match.FULL else route


_SEGMENTS = st.sampled_from(
    ["v1", "locks", "noop", "sagas", "steps", "acquire", "renew", "release", "force-release", "zone:A3", "",
     ".", "a b", "%2F"]
)  # fmt: skip
_LAST_SEGMENTS = [
    *("acquire", "renew", "release", "force-release", "acquire/", "Acquire", ""),
    *("heartbeat", "start", "complete", "fail", "abort"),
]
# Mostly near misses of a command path (each part right or not), some anything at all.
_COMMAND_LIKE = st.tuples(
    st.sampled_from(["v1", "v2", ""]),
    st.sampled_from(["locks", "noop", "noopish", "lock", "sagas"]),
    st.lists(_SEGMENTS, min_size=0, max_size=3),
    st.sampled_from(_LAST_SEGMENTS),
).map(lambda parts: "/".join(["", parts[0], parts[1], *parts[2], parts[3]]))
_PATHS = st.one_of(
    _COMMAND_LIKE, st.lists(_SEGMENTS, min_size=1, max_size=5).map(lambda parts: "/" + "/".join(parts))
)
_METHODS = st.sampled_from(["POST", "GET", "PUT", "HEAD"])


@settings(max_examples=400, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=_METHODS, path=_PATHS, root_path=st.sampled_from(["", "/svc"]))
def test_it_takes_exactly_what_the_router_gives_a_command_route(
    app: FastAPI, fast_path: CommandFastPath, method: str, path: str, root_path: str
) -> None:
    scope = http_scope(method, path, root_path)
    chosen = _routers_choice(app, scope)
    selected = fast_path.select(dict(scope))
    if isinstance(chosen, CommandRoute) and method in (chosen.methods or ()):
        assert selected is not None
        served, path_params = selected
        assert served.endpoint is chosen.endpoint
        assert path_params == chosen.matches(dict(scope))[1]["path_params"]
    else:
        assert selected is None


def test_every_command_route_is_served_by_it(fast_path: CommandFastPath) -> None:
    """Lock commands, their no-op twin and saga transitions alike."""
    sent = {"resource": "zone:A3", "saga_id": "saga-1", "step": "pick"}
    for route in [*commands.router.routes, *noop.router.routes, *sagas.commands.routes]:
        assert isinstance(route, CommandRoute)
        path = route.path
        for name, text in sent.items():
            path = path.replace(f"{{{name}}}", text)
        selected = fast_path.select(http_scope("POST", path))
        assert selected is not None
        assert selected[0].endpoint is route.endpoint
        assert selected[1] == {name: sent[name] for name in route.param_convertors}


def test_with_opentelemetry_on_the_router_serves_commands() -> None:
    assert _fast_path(_app(opentelemetry=True)) is None


def test_only_post_only_command_routes_are_accepted(app: FastAPI) -> None:
    with pytest.raises(TypeError, match="POST-only command routes"):
        CommandFastPath(app.router, routes=app.router.routes[:1], exception_handlers={})


_BODIES = st.one_of(
    st.just(b""),
    st.just(b"{not json"),
    st.just(b"[]"),
    st.builds(
        lambda ttl, token, owner: json.dumps(
            {k: v for k, v in {"ttl_ms": ttl, "fencing_token": token, "owner": owner}.items() if v != "-"}
        ).encode(),
        st.one_of(st.just("-"), st.integers(-5, 10**6), st.text(max_size=3)),
        st.one_of(st.just("-"), st.integers(-1, 10**3)),
        st.one_of(st.just("-"), st.sampled_from(["agent-1", "", "x" * 300])),
    ),
)
_HEADERS = st.fixed_dictionaries(
    {},
    optional={
        "idempotency-key": st.sampled_from(["", "k1", "k" * 300]),
        "content-type": st.sampled_from(["application/json", "text/plain", "application/merge-patch+json"]),
        "x-correlation-id": st.sampled_from(["c1", "c" * 300]),
    },
)
# The no-op's answers carry a counter and a clock; everything else must be the same byte for byte.
_VARYING = ("fencing_token", "expires_at")


def _outcome(response: httpx.Response) -> tuple[int, list[tuple[str, str]], Any]:
    headers = sorted((k, v) for k, v in response.headers.items() if k != "content-length")
    if response.headers.get("content-type", "").endswith("json"):
        body = response.json()
        if isinstance(body, dict):
            body = {k: v for k, v in body.items() if k not in _VARYING}
        return response.status_code, headers, body
    return response.status_code, headers, response.text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prefix=st.sampled_from(["/v1/noop", "/v1/locks"]),
    verb=st.sampled_from(["acquire", "renew", "release", "force-release"]),
    resource=st.sampled_from(["zone:A3", "..", "x" * 201, "bad resource"]),
    body=_BODIES,
    headers=_HEADERS,
)
async def test_it_answers_as_the_router_would(
    app: FastAPI, prefix: str, verb: str, resource: str, body: bytes, headers: dict[str, str]
) -> None:
    url = f"{prefix}/{resource}/{verb}"
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        fast = await client.post(url, content=body, headers=headers)
        with patch.object(CommandFastPath, "select", lambda self, scope: None):
            routed = await client.post(url, content=body, headers=headers)
    assert _outcome(fast) == _outcome(routed)
