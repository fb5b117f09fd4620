"""The resource path segment, shared by the command and query routers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path

from domain.resource import RESOURCE_MAX_LENGTH, RESOURCE_PATTERN

ResourcePath = Annotated[
    str,
    Path(
        pattern=RESOURCE_PATTERN,
        min_length=1,
        max_length=RESOURCE_MAX_LENGTH,
        description="Resource id, e.g. `pallet:42` or `zone:A3` (1-200 of `[A-Za-z0-9._:-]`, not only dots).",
    ),
]
