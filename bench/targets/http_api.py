"""lockledger's HTTP command API, and its no-op twin: the same requests to another path prefix.

Every command carries an ``Idempotency-Key`` (unique per command), as a careful agent sends it, so every
successful command also writes its idempotency record. Authentication is on: agent i sends its own API
token (``Authorization: Bearer``), whose name is the lease owner, so the bodies name no owner (as the SDK
does with a token). The no-op twin gets the same tokens and headers, so its ceiling pays for the same
authentication.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from itertools import count
from typing import Any

from bench.auth import AUTH
from bench.http_client import HttpClient, HttpConnection
from bench.targets.base import Agent, CommandFailed, Safety

LOCKS_PREFIX = "/v1/locks"
NOOP_PREFIX = "/v1/noop"


def _failure(command: str, status: int, body: bytes) -> CommandFailed:
    return CommandFailed(f"{command} -> HTTP {status}: {body[:200].decode(errors='replace')}")


class HttpAgent:
    """One agent on its own connection, which carries its token (the token's name owns its leases)."""

    def __init__(
        self, connection: HttpConnection, prefix: str, key_prefix: str, ttl_ms: int, wait_ms: int = 0
    ) -> None:
        self._connection = connection
        self._prefix = prefix
        self._keys = count()
        self._key_prefix = key_prefix
        body: dict[str, int] = {"ttl_ms": ttl_ms, **({"wait_ms": wait_ms} if wait_ms else {})}
        self._acquire_body = json.dumps(body).encode()

    def _key(self) -> str:
        return f"{self._key_prefix}{next(self._keys)}"

    async def acquire(self, resource: str) -> Any | None:
        status, body = await self._connection.post(
            f"{self._prefix}/{resource}/acquire", self._acquire_body, self._key()
        )
        if status == 201:
            return json.loads(body)["fencing_token"]
        if status == 409:
            return None
        raise _failure("acquire", status, body)

    async def renew(self, resource: str, token: Any) -> None:
        await self._command("renew", resource, token)

    async def release(self, resource: str, token: Any) -> None:
        await self._command("release", resource, token)

    async def _command(self, command: str, resource: str, token: Any) -> None:
        body = f'{{"fencing_token":{int(token)}}}'.encode()
        status, reply = await self._connection.post(f"{self._prefix}/{resource}/{command}", body, self._key())
        if status != 200:
            raise _failure(command, status, reply)


class HttpLockTarget:
    """``lockledger`` (prefix /v1/locks) or ``noop`` (prefix /v1/noop) on the bench's server.

    ``tokens[i]`` is agent i's API token; a cell of W agents needs at least W of them.
    """

    def __init__(
        self,
        name: str,
        prefix: str,
        client: HttpClient,
        run_id: str,
        ttl_ms: int,
        tokens: Sequence[str],
        wait_ms: int = 0,
    ) -> None:
        self.name = name
        self.safety = Safety(exclusive=True, monotonic_tokens=True) if prefix == LOCKS_PREFIX else None
        self._prefix = prefix
        self._client = client
        self._keys_prefix = f"{run_id}-{uuid.uuid4().hex[:8]}-{name}"  # unique per target instance
        self._ttl_ms = ttl_ms
        self._wait_ms = wait_ms
        self._tokens = tokens
        self._cells = count()
        self._cell = 0

    async def open(self) -> None:
        pass

    async def start_cell(self, workers: int) -> None:
        self._cell = next(self._cells)
        if workers > len(self._tokens):
            raise ValueError(f"{workers} agents but only {len(self._tokens)} API tokens")
        await self._client.open(self._tokens[:workers])

    def agent(self, index: int) -> Agent:
        return HttpAgent(
            self._client.connection(index),
            self._prefix,
            key_prefix=f"{self._keys_prefix}-{self._cell}-{index}-",
            ttl_ms=self._ttl_ms,
            wait_ms=self._wait_ms,
        )

    async def end_cell(self) -> None:
        await self._client.close()

    async def close(self) -> None:
        await self._client.close()

    def describe(self) -> dict[str, Any]:
        return {
            "path_prefix": self._prefix,
            "http_client": self._client.kind,
            "idempotency_key": True,
            "auth": AUTH,
            "acquire_wait_ms": self._wait_ms,
        }
