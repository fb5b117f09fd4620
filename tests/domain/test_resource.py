"""Which resource ids are valid: one URL path segment that every HTTP client leaves as it is."""

from __future__ import annotations

import pytest

from domain.resource import is_valid_resource


@pytest.mark.parametrize("resource", ["zone:A3", "pallet:42", "a", "a.", ".a", "..a", "x" * 200, "_", "-.-"])
def test_valid(resource: str) -> None:
    assert is_valid_resource(resource)


@pytest.mark.parametrize(
    "resource",
    # Dot-only ids are RFC 3986 dot-segments: clients resolve "/v1/locks/../acquire" to "/v1/acquire".
    ["", ".", "..", "...", "x" * 201, "a/b", "a b", "zone?A3", "é", "a\x00"],
)
def test_invalid(resource: str) -> None:
    assert not is_valid_resource(resource)
