"""The request path as the routes match it: without the root path a proxy mounted the app under."""

from __future__ import annotations

from starlette.types import Scope


def route_path(scope: Scope) -> str:
    """``scope["path"]`` less ``scope["root_path"]`` when the path lies under it (as Starlette's router
    strips it before matching), else the path as it is."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    rest = path[len(root) :]
    return rest if not rest or rest.startswith("/") else path
