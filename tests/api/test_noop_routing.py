"""The benchmark's no-op twin is matched first but charges the real commands nothing for it."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import APIRouter
from starlette.routing import Match

from bench import noop
from tests.api.routing import bench_app, first_match, http_scope


@pytest.fixture
def bench_app_routes() -> list[Any]:
    return list(bench_app().routes)


def test_a_command_path_never_tries_the_twins_routes(
    bench_app_routes: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    tried: list[str] = []
    original = APIRouter.matches

    def counting(self: APIRouter, scope: Any) -> Any:
        if self is noop.router:
            tried.append(scope["path"])
        return original(self, scope)

    monkeypatch.setattr(APIRouter, "matches", counting)
    for path in ("/v1/locks/zone-A3/acquire", "/v1/locks/zone-A3/release"):
        assert first_match(bench_app_routes, http_scope("POST", path)) is not None
    assert first_match(bench_app_routes, http_scope("POST", "/v1/noopish/x/acquire")) is None
    assert tried == []
    first_match(bench_app_routes, http_scope("POST", "/v1/noop/zone-A3/acquire"))
    assert tried == ["/v1/noop/zone-A3/acquire"]


def test_the_twin_still_serves_its_own_paths(bench_app_routes: list[Any]) -> None:
    noop = first_match(bench_app_routes, http_scope("POST", "/v1/noop/zone-A3/acquire"))
    command = first_match(bench_app_routes, http_scope("POST", "/v1/locks/zone-A3/acquire"))
    assert noop is not None
    assert command is not None
    noop_index = noop[0]
    assert noop[1] == command[1] == Match.FULL
    assert noop_index < command[0]  # first, where the commands are without it
    # Behind a proxy's root path, and for a method it does not serve (405, not 404).
    assert first_match(bench_app_routes, http_scope("POST", "/v1/noop/a/renew", root_path="/svc")) == (
        noop_index,
        Match.FULL,
    )
    assert first_match(bench_app_routes, http_scope("GET", "/v1/noop/a/release")) == (
        noop_index,
        Match.PARTIAL,
    )
