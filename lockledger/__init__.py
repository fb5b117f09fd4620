"""lockledger: the public face of the lock service (the `lockledger` CLI and the Python SDK).

Importing this package pulls in no server dependency, so an agent can use the client alone.
"""

from lockledger.breaker import BreakerConfig, CircuitBreaker, CircuitOpen, State
from lockledger.client import (
    AsyncClient,
    Client,
    ForceReleased,
    History,
    HistoryEvent,
    LeaseInfo,
    LockInfo,
    LockPage,
    Released,
)
from lockledger.errors import (
    Forbidden,
    IdempotencyKeyInProgress,
    IdempotencyKeyReused,
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

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AsyncLease",
    "BreakerConfig",
    "CircuitBreaker",
    "CircuitOpen",
    "Client",
    "Forbidden",
    "ForceReleased",
    "History",
    "HistoryEvent",
    "IdempotencyKeyInProgress",
    "IdempotencyKeyReused",
    "Lease",
    "LeaseExpired",
    "LeaseInfo",
    "LockHeld",
    "LockInfo",
    "LockLedgerError",
    "LockLost",
    "LockPage",
    "NotFound",
    "NotHolder",
    "Released",
    "State",
    "Unauthorized",
    "Unavailable",
    "ValidationError",
    "__version__",
]
