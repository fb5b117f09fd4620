"""The simulated network under one agent: lost responses, a crash switch, and what went over the wire.

``FaultyTransport`` wraps the agent's real httpx transport. With probability ``drop_probability`` a
command (a POST) is sent and processed by the server, and then its answer is thrown away and the client
sees ``httpx.ReadTimeout``: the SDK retries under the same Idempotency-Key and gets the stored answer
again (``Idempotent-Replayed: true``). After ``crash()`` nothing the agent sends leaves the process any
more (``AgentCrashed``, which the SDK does not retry), so its heartbeats stop and its leases are left to
the server's reaper, as when a robot loses power. Each release (of a lease or a shared lock's grant),
hand-off and release of a reservation's leases is reported to the ledger as it is sent: from that moment
the agent no longer acts on the resource.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import httpx

from lockledger.simulate.ledger import Ledger

__all__ = ["AgentCrashed", "FaultyTransport", "Wire"]

_LOCKS = "/v1/locks/"
_SHARED_LOCKS = "/v1/shared-locks/"
_RESERVATIONS = "/v1/reservations"
_ENDING = ("/release", "/handoff")  # a lock's commands after which its sender no longer acts on it


class AgentCrashed(Exception):
    """The simulated agent is dead: this request never left it."""


@dataclass
class Wire:
    """What every agent's transport saw, summed over the simulation."""

    requests: int = 0  # sent to the server, retries included
    grants: int = 0  # new leases the server answered: acquired, reserved, handed to a receiver (not replays)
    lock_held: int = 0  # acquires and reserves answered 409: held (after the server's wait, if any)
    dropped: int = 0  # answers thrown away after the server processed the command
    replayed: int = 0  # answers marked Idempotent-Replayed: a retry found the stored answer


class FaultyTransport(httpx.AsyncBaseTransport):
    def __init__(
        self,
        inner: httpx.AsyncBaseTransport,
        *,
        rng: random.Random,
        drop_probability: float,
        wire: Wire,
        ledger: Ledger,
    ) -> None:
        self._inner = inner
        self._rng = rng
        self._drop_probability = drop_probability
        self._wire = wire
        self._ledger = ledger
        self.crashed = False

    def crash(self) -> None:
        self.crashed = True

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.crashed:
            raise AgentCrashed(f"{request.method} {request.url.path}: the agent has crashed")
        path = request.url.path
        command = request.method == "POST"
        if command:
            self._report_ending(path, request.content)
        self._wire.requests += 1
        response = await self._inner.handle_async_request(request)
        if response.headers.get("Idempotent-Replayed") == "true":
            self._wire.replayed += 1
        elif command and (path.endswith(("/acquire", "/handoff")) or path == _RESERVATIONS):
            if response.is_success:
                self._wire.grants += await _leases_granted(path, response)
            elif response.status_code == 409 and not path.endswith("/handoff"):
                self._wire.lock_held += 1
        if command and self._rng.random() < self._drop_probability:
            await response.aread()
            await response.aclose()
            self._wire.dropped += 1
            raise httpx.ReadTimeout("simulated: the answer was lost on the way back", request=request)
        return response

    def _report_ending(self, path: str, content: bytes) -> None:
        """Tell the ledger of a release, hand-off or reservation release this command sends."""
        shared = path.startswith(_SHARED_LOCKS)
        if (shared or path.startswith(_LOCKS)) and path.endswith(_ENDING):
            resource = path[len(_SHARED_LOCKS if shared else _LOCKS) :].rsplit("/", 1)[0]
            token = int(json.loads(content or b"{}").get("fencing_token", 0))
            self._ledger.released(resource, token, shared=shared)
        elif path.startswith(f"{_RESERVATIONS}/") and path.endswith("/release"):
            for lease in json.loads(content or b"{}").get("leases", []):
                self._ledger.released(lease["resource"], int(lease["fencing_token"]))

    async def aclose(self) -> None:
        await self._inner.aclose()


async def _leases_granted(path: str, response: httpx.Response) -> int:
    """How many leases a successful acquire, hand-off or reserve granted: a reserve's set, else one."""
    if path != _RESERVATIONS:
        return 1
    await response.aread()
    return len(response.json()["leases"])
