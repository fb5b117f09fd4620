"""Clients that misbehave as real ones do, with real tokens, for the tests of what the server logs and
how it holds up (tests/storage/test_logging_http.py, tests/faults/test_hostile_clients.py).

A change-feed reader that stops reading fills the kernel's buffers before the server's own: loopback's
send buffer grows to ``tcp_wmem``'s 4 MiB. So a stalled reader here catches up on a backlog of that size
(``backlog``: events with names near the 200-character limit, appended in-process), which makes the
server's write buffer fill and its write deadline run out soon, instead of after minutes of live events.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from pathlib import Path
from typing import Any

from domain.commands import Acquire
from service.lock_service import CommandContext, LockService

BACKLOG_EVENTS = 8_000  # about 8 MB of server-sent events: more than the socket buffers hold
_BODY = b'{"ttl_ms": 5000, "wait_ms": 0}' + b" " * 200


def hang_up_mid_body(port: int, token: str, path: str) -> None:
    """An authenticated POST to ``path`` that sends half its body, then resets the connection."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(_BODY)}\r\n\r\n".encode()
            + _BODY[: len(_BODY) // 2]
        )
        time.sleep(0.05)  # the server has begun reading the body
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def stalled_reader(port: int, token: str, prefix: str) -> socket.socket:
    """A change-feed subscription to every event of ``prefix`` from the start of the log, with a 4 KiB
    receive buffer, never read."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(
        f"GET /v1/events/stream?after_position=0&prefix={prefix} HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {token}\r\nAccept: text/event-stream\r\n\r\n".encode()
    )
    return sock


async def backlog(lock_service: LockService, prefix: str, events: int = BACKLOG_EVENTS) -> None:
    """``events`` acquires of distinct resources of ``prefix`` with names near the 200-character limit."""
    gate = asyncio.Semaphore(32)
    owner = "o" * 200

    async def acquire(i: int) -> None:
        resource = f"{prefix}{i}:".ljust(200, "r")
        async with gate:
            await lock_service.execute(Acquire(resource, owner, 600_000), CommandContext(principal=owner))

    await asyncio.gather(*(acquire(i) for i in range(events)))


def log_lines(log_path: Path) -> list[dict[str, Any]]:
    """A server's JSON log lines (the CLI's banner lines before them are plain text)."""
    text = log_path.read_text(errors="replace")
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]
