"""Graceful shutdown reaches the requests that would otherwise wait it out.

uvicorn's graceful shutdown stops accepting connections and then waits for every request in flight;
the app's lifespan hears of it only after that. An acquire waiting for a held lock (``wait_ms``, up to
``LOCKLEDGER_MAX_WAIT_MS``) would hold the shutdown for the rest of its wait, and a supervisor that
loses patience would cut it off with a transport error. uvicorn does tell each connection first (its
protocol's ``shutdown()``), so this protocol passes the word on: the lifespan puts the lock service's
``drain`` into its state, and the first connection told to shut down calls it. Every waiting acquire
then answers 503 ``unavailable`` with ``Retry-After`` at once, and its client retries (the SDK does, under
the same Idempotency-Key) against a server that stays up.
"""

from __future__ import annotations

from api.limits import HeaderCappedHttpToolsProtocol

DRAIN = "lockledger.drain"  # the lifespan state's key: a callable that ends every wait


class DrainingHttpToolsProtocol(HeaderCappedHttpToolsProtocol):
    """``HeaderCappedHttpToolsProtocol`` that starts the service's drain when uvicorn begins shutting
    down. Select it with ``uvicorn.run(..., http="api.draining:DrainingHttpToolsProtocol")``."""

    def shutdown(self) -> None:
        drain = self.app_state.get(DRAIN)
        if drain is not None:
            drain()
        super().shutdown()
