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


Command = Acquire | Renew | Release | Expire | ForceRelease
