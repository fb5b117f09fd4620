"""What a command came to, as plain records: the service's answer, which ``api/`` turns into HTTP.

An outcome carries the fields of the answer and nothing of HTTP: no status code, no JSON. Its fields are
also what an Idempotency-Key keeps (``idempotency_keys.response``), so a replay rebuilds the same
outcome and is rendered byte for byte as the first answer was.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from domain.commands import Accept, Acquire, Command, Decline, HandOff, Release, Renew
from domain.events import DEADLINE_FIELD, Event, LockForceReleased, LockHandedOff
from domain.value import value


@value
class Granted:
    """An acquire or a renew: the lease, with its deadline by the store's clock."""

    resource: str
    owner: str
    fencing_token: int
    expires_at: datetime
    ttl_ms: int


@value
class Released:
    """A release: the lease it ended."""

    resource: str
    owner: str
    fencing_token: int
    released: bool = True


@value
class ForceReleased:
    """A force-release: the lease it ended and why, or ``released=False`` when none was live."""

    resource: str
    released: bool
    owner: str | None = None
    fencing_token: int | None = None
    event: str | None = None
    reason: str | None = None


@value
class HandedOff:
    """A hand-off: the receiver's lease (its token, and the deadline by which it must accept) and the
    giver's, which it ended."""

    resource: str
    owner: str
    fencing_token: int
    expires_at: datetime
    accept_within_ms: int
    from_owner: str
    from_token: int


Outcome = Granted | Released | ForceReleased | HandedOff


@value
class CommandResult:
    outcome: Outcome
    replayed: bool = False  # the stored outcome of an earlier request with the same Idempotency-Key


def answer_fields(command: Command, events: list[Event]) -> dict[str, Any]:
    """The fields of the answer to ``command`` decided as ``events``, as stored under its key; a grant's
    deadline is added by the commit, which alone knows it."""
    resource = command.resource
    if not events:  # only a force-release of a free lock decides nothing and still answers
        return {"resource": resource, "released": False, "owner": None, "fencing_token": None}
    last = events[-1]
    if isinstance(last, LockHandedOff):
        return {
            "resource": resource,
            "owner": last.owner,
            "fencing_token": last.fencing_token,
            "accept_within_ms": last.ttl_ms,
            "from_owner": last.from_owner,
            "from_token": last.from_token,
        }
    if isinstance(command, Acquire | Renew | Accept):
        return {
            "resource": resource,
            "owner": last.owner,
            "fencing_token": last.fencing_token,
            "ttl_ms": getattr(last, "ttl_ms", None),
        }
    if isinstance(command, Release | Decline):
        return {
            "resource": resource,
            "owner": last.owner,
            "fencing_token": last.fencing_token,
            "released": True,
        }
    return {
        "resource": resource,
        "released": True,
        "owner": last.owner,
        "fencing_token": last.fencing_token,
        "event": last.type,
        "reason": last.reason if isinstance(last, LockForceReleased) else None,
    }


def outcome_of(command: Command, fields: dict[str, Any], expires_at: datetime | None = None) -> Outcome:
    """The outcome of ``command`` from its answer's fields (a grant's deadline given, or parsed from a
    stored answer)."""
    if isinstance(command, Acquire | Renew | Accept | HandOff):
        deadline = expires_at or datetime.fromisoformat(fields[DEADLINE_FIELD])
        if isinstance(command, HandOff):
            return HandedOff(
                fields["resource"], fields["owner"], fields["fencing_token"], deadline,
                fields["accept_within_ms"], fields["from_owner"], fields["from_token"],
            )  # fmt: skip
        return Granted(
            fields["resource"], fields["owner"], fields["fencing_token"], deadline, fields["ttl_ms"]
        )
    if isinstance(command, Release | Decline):
        return Released(fields["resource"], fields["owner"], fields["fencing_token"])
    return ForceReleased(
        fields["resource"],
        fields["released"],
        fields.get("owner"),
        fields.get("fencing_token"),
        fields.get("event"),
        fields.get("reason"),
    )
