"""The benchmark's no-op twin is matched first but charges the real commands nothing for it."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import APIRouter
from starlette.routing import Match

from api import noop
from api.app import create_app
from service.config import Settings
from tests.api.scopes import http_scope


@pytest.fixture
def bench_app_routes() -> list[Any]:
    settings = Settings(dev_mode=True, bench_noop=True, database_url="postgresql://unused@127.0.0.1/none")
    return list(create_app(settings).routes)


def _match(routes: list[Any], scope: dict[str, Any]) -> tuple[int, Match] | None:
    """The first route that matches fully (as Starlette's router picks), or the first partial one."""
    partial: tuple[int, Match] | None = None
    for index, route in enumerate(routes):
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return index, match
        if match == Match.PARTIAL and partial is None:
            partial = (index, match)
    return partial


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
        assert _match(bench_app_routes, http_scope("POST", path)) is not None
    assert _match(bench_app_routes, http_scope("POST", "/v1/noopish/x/acquire")) is None
    assert tried == []
    _match(bench_app_routes, http_scope("POST", "/v1/noop/zone-A3/acquire"))
    assert tried == ["/v1/noop/zone-A3/acquire"]


def test_the_twin_still_serves_its_own_paths(bench_app_routes: list[Any]) -> None:
    noop = _match(bench_app_routes, http_scope("POST", "/v1/noop/zone-A3/acquire"))
    command = _match(bench_app_routes, http_scope("POST", "/v1/locks/zone-A3/acquire"))
    assert noop is not None
    assert command is not None
    noop_index = noop[0]
    assert noop[1] == command[1] == Match.FULL
    assert noop_index < command[0]  # first, where the commands are without it
    # Behind a proxy's root path, and for a method it does not serve (405, not 404).
    assert _match(bench_app_routes, http_scope("POST", "/v1/noop/a/renew", root_path="/svc")) == (
        noop_index,
        Match.FULL,
    )
    assert _match(bench_app_routes, http_scope("GET", "/v1/noop/a/release")) == (noop_index, Match.PARTIAL)
