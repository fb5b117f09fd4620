"""ASGI scopes for asking routes and the fast path which of them a request would reach."""

from __future__ import annotations

from typing import Any


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
