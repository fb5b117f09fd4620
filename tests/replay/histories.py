"""Lock histories for replay's tests: hypothesis draws the steps, the pure decider decides them, and
:func:`write_history` appends what it decided at the instants it chose (deadlines that pass between
events included), as the owner of the schema may. Leases are handed off too, and the hand-offs accepted
or declined (docs/decisions/0047-lease-hand-off.md), so every fold here meets them. Acquires by
``agv-1`` are taken in a reservation (``metadata.reservation_id``, as a reserve's grants carry it), so
replay's rows and holding_periods name one.

Each resource also has a shared lock of the same name (stream ``shared/<resource>``, decision 0051; a lock
of its own, with its own tokens): ``r0`` a semaphore of 2 permits, the others read/write locks. Their
grants are acquired in either mode, renewed, released and expired among the mutex's steps."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta

from hypothesis import strategies as st

from domain.commands import Accept, Acquire, Command, Decline, Expire, ForceRelease, HandOff, Release, Renew
from domain.decider import decide, evolve
from domain.errors import DomainError
from domain.events import event_payload, stamp
from domain.shared_lock import (
    EXCLUSIVE,
    SHARED,
    AcquireShared,
    ExpireShared,
    ReleaseShared,
    RenewShared,
    SharedCommand,
    SharedLockState,
    shared_event_payload,
)
from domain.shared_lock import decide as decide_shared
from domain.shared_lock import evolve as evolve_shared
from domain.shared_lock import initial_state as initial_shared
from domain.shared_lock import stamp as stamp_shared
from domain.shared_lock import stream_id as shared_stream
from domain.state import LockState, initial_state
from eventstore.connection import Connection

Step = tuple[int, int, str, int, int]  # gap ms, resource, command, owner, ttl ms
steps = st.lists(
    st.tuples(
        st.integers(0, 3_000),
        st.integers(0, 2),
        st.sampled_from(
            [
                *(
                    "acquire",
                    "renew",
                    "release",
                    "expire",
                    "force",
                    "handoff",
                    "handoff",
                    "accept",
                    "decline",
                ),
                *("read", "read", "write", "s-renew", "s-release", "s-expire"),  # the shared lock's steps
            ]
        ),
        st.integers(0, 2),
        st.sampled_from([200, 1_000, 2_500]),
    ),
    min_size=1,
    max_size=30,
)


@dataclass
class Logged:
    position: int
    resource: str
    version: int
    type: str
    data: dict[str, object]
    recorded_at: datetime
    metadata: dict[str, str]


def _command(kind: str, resource: str, owner: str, ttl_ms: int, state: LockState) -> Command:
    if kind == "acquire":
        return Acquire(resource, owner, ttl_ms)
    if kind == "renew":
        return Renew(resource, state.owner or owner, state.fencing_token, ttl_ms)
    if kind == "release":
        return Release(resource, state.owner or owner, state.fencing_token)
    if kind == "expire":
        return Expire(resource)
    if kind == "handoff":  # to ``owner``: refused (and skipped) when that is the holder itself
        return HandOff(resource, state.owner or owner, state.fencing_token, owner, ttl_ms)
    if kind == "accept":
        return Accept(resource, state.owner or owner, ttl_ms)
    if kind == "decline":
        return Decline(resource, state.owner or owner)
    return ForceRelease(resource, "hypothesis")


def _target(states: dict[int, LockState], drawn: int, kind: str) -> int:
    """The resource a step acts on: the drawn one, but a hand-off goes to a held lock and an accept or
    decline to a lock whose hand-off awaits, when there is one, so that hand-offs are not rare."""
    if kind == "handoff":
        return next((i for i, s in states.items() if s.status == "held"), drawn)
    if kind in ("accept", "decline"):
        return next((i for i, s in states.items() if s.handed_off_by is not None), drawn)
    return drawn


SHARED_STEPS = {"read": SHARED, "write": EXCLUSIVE}


def _shared_command(kind: str, index: int, owner: str, ttl_ms: int, state: SharedLockState) -> SharedCommand:
    """A shared-lock step: a read (a permit of ``r0``'s semaphore) or write acquire, or the renewal or
    release of ``owner``'s grant (another's when it has none: refused, and skipped), or the reaper's."""
    if kind in SHARED_STEPS:
        return AcquireShared(state.resource, owner, SHARED_STEPS[kind], ttl_ms, 2 if index == 0 else None)
    if kind == "s-expire":
        return ExpireShared(state.resource)
    grants = sorted(state.grants, key=lambda grant: grant.owner != owner)
    token = grants[0].fencing_token if grants else 0
    if kind == "s-renew":
        return RenewShared(state.resource, owner, token, ttl_ms)
    return ReleaseShared(state.resource, owner, token)


async def append_event(
    conn: Connection,
    stream: str,
    version: int,
    kind: str,
    data: dict[str, object],
    metadata: dict[str, str],
    now: datetime,
) -> Logged:
    """Append an event as it was recorded at ``now``, as the owner of the schema may."""
    position = await conn.fetchval(
        """INSERT INTO events (stream_id, stream_version, event_type, data, metadata, recorded_at)
           VALUES ($1, $2, $3, $4::jsonb, $5::jsonb, $6) RETURNING position""",
        stream, version, kind, json.dumps(data), json.dumps(metadata), now,
    )  # fmt: skip
    return Logged(position, stream, version, kind, data, now, metadata)


async def write_history(conn: Connection, prefix: str, start: datetime, story: list[Step]) -> list[Logged]:
    states = {i: initial_state(f"{prefix}r{i}") for i in range(3)}
    shared = {i: initial_shared(f"{prefix}r{i}") for i in range(3)}
    now = start
    logged: list[Logged] = []
    for gap_ms, drawn, kind, owner, ttl_ms in story:
        # Agents hand off and take up promptly: a quarter of the gap (a short hand-off still lapses).
        quick = kind in ("handoff", "accept", "decline")
        now += timedelta(milliseconds=gap_ms // 4 if quick else gap_ms, microseconds=1)
        if kind.startswith("s-") or kind in SHARED_STEPS:
            lock = shared[drawn]
            try:
                decided = decide_shared(lock, _shared_command(kind, drawn, f"agv-{owner}", ttl_ms, lock), now)
            except DomainError:
                continue
            for shared_event in stamp_shared(decided, now):
                lock = evolve_shared(lock, shared_event)
                logged.append(
                    await append_event(
                        conn, shared_stream(lock.resource), lock.version, shared_event.type,
                        shared_event_payload(shared_event), {}, now,
                    )
                )  # fmt: skip
            shared[drawn] = lock
            continue
        index = _target(states, drawn, kind)
        state = states[index]
        try:
            events = stamp(
                decide(state, _command(kind, state.resource, f"agv-{owner}", ttl_ms, state), now), now
            )
        except DomainError:
            continue
        for event in events:
            state = evolve(state, event)
            data = event_payload(event)
            reserved = kind == "acquire" and data["owner"] == "agv-1"
            metadata = {"reservation_id": f"trip-{len(logged)}"} if reserved else {}
            logged.append(
                await append_event(conn, state.resource, state.version, event.type, data, metadata, now)
            )
        states[index] = state
    return logged
