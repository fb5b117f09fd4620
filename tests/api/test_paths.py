"""``route_path`` strips a proxy's root path exactly as Starlette's router does before it matches."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from starlette.routing import Route, Router

from api.paths import route_path

segments = st.lists(st.sampled_from(["v1", "locks", "a", "", "api", "v1x"]), max_size=4).map("/".join)


@given(root=segments, path=segments)
def test_route_path_agrees_with_starlette(root: str, path: str) -> None:
    root_path = f"/{root}" if root else ""
    full = root_path + "/" + path

    async def never_called(request: object) -> None:
        raise AssertionError("only matched")

    router = Router([Route("/{rest:path}", never_called)])
    scope = {"type": "http", "path": full, "root_path": root_path, "method": "GET"}
    match, child = router.routes[0].matches(scope)
    assert match.name == "FULL"
    assert route_path(scope) == "/" + child["path_params"]["rest"]
