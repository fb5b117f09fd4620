"""What a resource id and a lease TTL may be.

A resource is always exactly one URL path segment, so ``/`` is excluded; the bounds are the contract
of DESIGN.md and are checked here so every entry point (HTTP, SDK, CLI) rejects the same inputs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# At least one character that is not a dot: "." and ".." are path segments every HTTP client rewrites
# (RFC 3986 dot-segments), so such a resource could never be addressed. Length is checked separately
# (1-200), since a length bound on this pattern would need lookahead, which pydantic's engine lacks.
RESOURCE_PATTERN = r"^[A-Za-z0-9._:\-]*[A-Za-z0-9_:\-][A-Za-z0-9._:\-]*$"
RESOURCE_MAX_LENGTH = 200
# The resource rule in words, for error messages and the API's documentation.
RESOURCE_RULE = "1-200 characters of A-Z, a-z, 0-9 and . _ : - (not only dots); no '/'"
OWNER_PATTERN = r"^[A-Za-z0-9._:@\-]{1,200}$"
_RESOURCE_RE = re.compile(RESOURCE_PATTERN)
_OWNER_RE = re.compile(OWNER_PATTERN)


def is_valid_resource(resource: str) -> bool:
    return len(resource) <= RESOURCE_MAX_LENGTH and bool(_RESOURCE_RE.fullmatch(resource))


def is_valid_owner(owner: str) -> bool:
    return bool(_OWNER_RE.fullmatch(owner))


@dataclass(frozen=True, slots=True)
class TtlBounds:
    """Inclusive bounds on a lease TTL in milliseconds, and the default when a command names none."""

    min_ms: int = 1_000
    max_ms: int = 3_600_000
    default_ms: int = 30_000

    def contains(self, ttl_ms: int) -> bool:
        return self.min_ms <= ttl_ms <= self.max_ms
