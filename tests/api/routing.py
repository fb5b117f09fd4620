"""Asking a benchmark app's routes which of them would serve a request, as Starlette's router picks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from starlette.routing import BaseRoute, Match

from bench.app import create_app
from service.config import Settings


def bench_app(**overrides: Any) -> FastAPI:
    """The app with the no-op twin mounted, in dev mode, never started (so it needs no database)."""
    return create_app(Settings(dev_mode=True, database_url="postgresql://unused@127.0.0.1/none", **overrides))


def http_scope(method: str, path: str, root_path: str = "") -> dict[str, Any]:
    """An HTTP request's scope as uvicorn makes it, behind a proxy's ``root_path`` if one is given."""
    return {
        "type": "http",
        "method": method,
        "path": root_path + path,
        "root_path": root_path,
        "headers": [],
        "query_string": b"",
    }


def first_match(routes: Sequence[BaseRoute], scope: dict[str, Any]) -> tuple[int, Match] | None:
    """The first route that matches fully (as Starlette's router picks), or the first partial one."""
    partial: tuple[int, Match] | None = None
    for index, route in enumerate(routes):
        match, _ = route.matches(dict(scope))
        if match == Match.FULL:
            return index, match
        if match == Match.PARTIAL and partial is None:
            partial = (index, match)
    return partial
