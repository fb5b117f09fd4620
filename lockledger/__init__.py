"""lockledger: the public face of the lock service (the `lockledger` CLI and the Python SDK).

Importing this package pulls in no server code, so an agent can use the client alone. Every duration in
the SDK is seconds as a float (``ttl``, ``wait``, ``timeout``, ``retry_timeout``, ``retry_after``). The
result dataclasses (``LeaseInfo``, ``LockInfo``, ``LockPage``, ``Released``, ``ForceReleased``,
``History``, and the replay API's ``ReplayState``, ``ReplayLease``, ``Changes``, ``Change``,
``AgentHistory``) are in ``lockledger.client``, with ``Event``, the one record of a logged event that
history, export and the feed return (also named ``HistoryEvent``, ``AgentEvent``, ``ExportedEvent``);
every error class is in ``lockledger.errors``. The command line is ``lockledger.cli`` (the ``cli`` extra).
"""

from lockledger.client import AsyncClient, Client
from lockledger.errors import (
    Forbidden,
    LeaseExpired,
    LockHeld,
    LockLedgerError,
    LockLost,
    NotFound,
    NotHolder,
    Unauthorized,
    Unavailable,
    ValidationError,
)
from lockledger.lease import AsyncLease, Lease
from lockledger.reservation import AsyncReservation, Reservation, ReservationInfo
from lockledger_breaker import BreakerConfig, CircuitBreaker, CircuitOpen, State

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AsyncLease",
    "AsyncReservation",
    "BreakerConfig",
    "CircuitBreaker",
    "CircuitOpen",
    "Client",
    "Forbidden",
    "Lease",
    "LeaseExpired",
    "LockHeld",
    "LockLedgerError",
    "LockLost",
    "NotFound",
    "NotHolder",
    "Reservation",
    "ReservationInfo",
    "State",
    "Unauthorized",
    "Unavailable",
    "ValidationError",
    "__version__",
]
