"""Value objects: immutable where immutability is checked, and cheap to build where they are built.

Every command builds a dozen small records (the command, its context, the events, the states they fold
into, the append plan, the result). A ``@dataclass(frozen=True)`` sets each field through
``object.__setattr__``, a measurable share of a command's work (docs/decisions/0016-value-records.md).
``@value`` classes are the same
dataclasses (slots, equality, a hash over the fields) built with plain assignments, and they stay frozen
for the type checker: ``dataclass_transform(frozen_default=True)`` makes mypy, which CI runs in strict
mode, reject any assignment to a field after construction (``tests/domain/test_value_objects.py``
checks that it does). ``dataclasses.replace`` makes a changed copy, as with frozen dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from typing_extensions import dataclass_transform

T = TypeVar("T")


@dataclass_transform(frozen_default=True)
def value(cls: type[T]) -> type[T]:
    """Make ``cls`` a slotted dataclass that compares and hashes by its fields and is frozen for mypy."""
    return dataclass(slots=True, unsafe_hash=True)(cls)
