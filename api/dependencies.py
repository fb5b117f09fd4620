"""The resource path segment, shared by the command and query routers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path

from domain.resource import RESOURCE_MAX_LENGTH, RESOURCE_PATTERN, RESOURCE_RULE

ResourcePath = Annotated[
    str,
    Path(
        pattern=RESOURCE_PATTERN,
        min_length=1,
        max_length=RESOURCE_MAX_LENGTH,
        description=f"Resource id, e.g. `pallet:42` or `zone:A3`: {RESOURCE_RULE}.",
    ),
]
