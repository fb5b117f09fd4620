"""Commands: what an agent, the reaper or an admin asks of one lock.

Clients never send absolute times: a lease is a duration (``ttl_ms``) that the database clock turns
into a deadline, so client clock skew can neither extend nor shorten it.
"""

from __future__ import annotations

from domain.value import value


@value
class Acquire:
    """``wait_ms``: how long the service may wait for a held lock to come free before refusing. The
    decision never waits; the service asks it again each time the lock may have come free."""

    resource: str
    owner: str
    ttl_ms: int
    wait_ms: int = 0


@value
class Renew:
    """The heartbeat. ``ttl_ms=None`` keeps the TTL the lease was granted with."""

    resource: str
    owner: str
    fencing_token: int
    ttl_ms: int | None = None


@value
class Release:
    resource: str
    owner: str
    fencing_token: int


@value
class Expire:
    """Issued by the reaper for a lease whose deadline has passed."""

    resource: str


@value
class ForceRelease:
    """An operator ends whatever lease is live, e.g. for a robot that was powered off by hand."""

    resource: str
    reason: str


@value
class HandOff:
    """The holder passes its live lease to the agent ``to`` in one step (docs/decisions/0047): ``to`` holds
    it at once with a new fencing token, for ``accept_within_ms``, and must accept (or decline) by then."""

    resource: str
    owner: str
    fencing_token: int
    to: str
    accept_within_ms: int


@value
class Accept:
    """The receiver of a hand-off takes it up: the lease is renewed for ``ttl_ms`` and its token returned.
    No token is sent: the receiver learns it here, once; only a hand-off not yet accepted can be."""

    resource: str
    owner: str
    ttl_ms: int


@value
class Decline:
    """The receiver of a hand-off refuses it: the lease ends now (released), as if it had lapsed."""

    resource: str
    owner: str


Command = Acquire | Renew | Release | Expire | ForceRelease | HandOff | Accept | Decline
