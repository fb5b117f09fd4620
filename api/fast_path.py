"""The command endpoints (lock commands and saga transitions) served from the middleware stack, past
the router.

An agent's acquire, heartbeat and release are nearly all of the traffic, and on their way from the HTTP
server to ``CommandRoute``'s handler FastAPI passes each through five more layers that a command endpoint
does not use: Starlette's exception middleware, FastAPI's exit-stack middleware, the router trying the
included routers in turn, the route's own two exit stacks (with the middleware's, three
``AsyncExitStack`` per request, for dependencies with ``yield`` and uploaded files) and the exception
wrapper around them. Measured: half of the no-op twin's server CPU per request
(docs/decisions/0005-command-fast-path.md). ``CommandFastPath`` sits innermost of the
app's own middleware, so the request limits, the error middleware and FastAPI's outer layers still see
every request, matches a POST against the command routes' own path patterns, and calls their handler,
turning an exception into the response the app's exception handlers give (what Starlette's exception
middleware does). Anything else, a GET, a path no command route matches, goes down the stack as before.

The routes are the ones the router would pick: the command routers are included before every other one
except the documentation's pages and assets (under /docs, /redoc and /openapi.json), and
``tests/api/test_fast_path.py`` holds the fast path to the router's choice. With OpenTelemetry on, the
app serves commands through the router (``api/app.py``) so that every span FastAPI's instrumentation
opens is still there.

Verified with FastAPI 0.165 and Starlette 1.10 (pinned in pyproject.toml); ``tests/api/test_fast_path.py``
fails when an upgrade changes what this relies on.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Coroutine, Iterable, Mapping
from typing import Any, NamedTuple

from fastapi import Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from api.command_route import CommandRoute
from api.paths import route_path

Handler = Callable[[Request], Coroutine[Any, Any, Response]]
ErrorHandler = Callable[[Request, Exception], Coroutine[Any, Any, Response]]


class Served(NamedTuple):
    pattern: re.Pattern[str]  # the route's own, as Starlette matches it
    handler: Handler  # CommandRoute's
    endpoint: Callable[..., Any]


class CommandFastPath:
    """Serve POSTs that a ``CommandRoute`` matches with its handler; pass everything else on."""

    __slots__ = ("_error_handlers", "_routes", "_status_handlers", "app")

    def __init__(
        self,
        app: ASGIApp,
        routes: Iterable[BaseRoute],
        exception_handlers: Mapping[Any, Callable[..., Any]],
    ) -> None:
        self.app = app
        # Keyed by the path's last segment (acquire, renew, ...), so a request tries one or two patterns.
        self._routes: dict[str, list[Served]] = {}
        for route in routes:
            if not isinstance(route, CommandRoute) or route.methods != {"POST"}:
                raise TypeError(f"{route}: the fast path serves POST-only command routes")
            served = Served(route.path_regex, route.get_route_handler(), route.endpoint)
            self._routes.setdefault(route.path.rpartition("/")[2], []).append(served)
        # As FastAPI hands them to Starlette's exception middleware: 500 and Exception stay with the
        # error middleware outside, which answers them.
        handlers = exception_handlers.items()
        self._status_handlers = {k: v for k, v in handlers if isinstance(k, int) and k != 500}
        self._error_handlers = {k: v for k, v in handlers if not isinstance(k, int) and k is not Exception}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        selected = self.select(scope)
        if selected is None:
            await self.app(scope, receive, send)
            return
        served, path_params = selected
        scope["endpoint"] = served.endpoint
        scope["path_params"] = path_params
        await self._serve(served.handler, scope, receive, send)

    def select(self, scope: Scope) -> tuple[Served, dict[str, Any]] | None:
        """The command route this request is for and its path parameters; None to pass it on."""
        if scope["type"] != "http" or scope["method"] != "POST":
            return None
        path = route_path(scope)
        for served in self._routes.get(path.rpartition("/")[2], ()):
            match = served.pattern.match(path)
            if match is not None:
                return served, match.groupdict()
        return None

    async def _serve(self, handler: Handler, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        try:
            response = await handler(request)
        except Exception as error:
            answer = self._error_handler(error)
            if answer is None:
                raise
            response = await answer(request, error)
            error.__traceback__ = None  # as Starlette does: a reused exception would pile up tracebacks
        await response(scope, receive, send)

    def _error_handler(self, error: Exception) -> ErrorHandler | None:
        if isinstance(error, HTTPException) and error.status_code in self._status_handlers:
            return self._status_handlers[error.status_code]
        for cls in type(error).__mro__:
            if cls in self._error_handlers:
                return self._error_handlers[cls]
        return None
