"""The record of a fault-injection run, and the checker that judges it against the event log.

A client under faults cannot know everything: a request that timed out or lost its connection may or may
not have been applied. So the recorder keeps every HTTP request the load sent (each retry and each
deliberate duplicate is a request of its own) with the instant it was sent and what came back, in three
kinds of outcome:

- ``ok``: a 2xx; the service promised the command is in the log, exactly as the body says;
- ``failed``: a 4xx, a definite refusal (``lock_held``, ``not_holder``, ``lease_expired``, ...);
- ``indeterminate``: a timeout, a broken connection, or a 5xx. A 503 counts here too: the service answers
  503 when its own round trip to PostgreSQL timed out, and a statement that timed out on the client side
  may still commit on the server.

The checker then reads the ``events`` table (as the schema owner) and reports every breach of the
contract it can see as a :class:`Violation`; a scenario passes only with none. It is pure over plain
records (:func:`check`), so ``test_history.py`` can feed it hand-made broken histories and show that it
fails when it should; :func:`audit` is the database half that loads those records.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import asyncpg
import httpx

from domain.events import (
    LOCK_ACQUIRED,
    LOCK_EXPIRED,
    LOCK_FORCE_RELEASED,
    LOCK_RELEASED,
    LOCK_RENEWED,
)
from eventstore.dburl import asyncpg_dsn
from eventstore.verify import VerifyReport, verify_chains

# --------------------------------------------------------------------------------------------------
# The recorder
# --------------------------------------------------------------------------------------------------


class Outcome(StrEnum):
    PENDING = "pending"  # sent, no answer yet (the checker treats a request left so as indeterminate)
    OK = "ok"
    FAILED = "failed"
    INDETERMINATE = "indeterminate"


@dataclass
class Operation:
    """One HTTP request of the load: what was asked, when, and what the client learned."""

    id: int
    client: str
    command: str  # acquire | renew | release
    resource: str
    body: dict[str, Any]
    key: str  # the Idempotency-Key: one per logical command, shared by its retries and duplicates
    attempt: int  # 1 for the first try, 2.. for retries after an indeterminate outcome
    copy: int  # 0 for the request the client waits on; 1 and 2 for deliberate duplicates (load.py)
    invoked_mono: float
    invoked_wall: datetime
    completed_mono: float | None = None
    outcome: Outcome = Outcome.PENDING
    status: int | None = None
    code: str | None = None  # problem+json ``code`` of a non-2xx answer
    response: dict[str, Any] | None = None  # the body of a 2xx
    replayed: bool = False  # ``Idempotent-Replayed: true``
    error: str | None = None  # transport error of an indeterminate outcome

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK

    @property
    def failed(self) -> bool:
        return self.outcome is Outcome.FAILED

    @property
    def indeterminate(self) -> bool:
        return self.outcome in (Outcome.INDETERMINATE, Outcome.PENDING)


@dataclass(frozen=True)
class Fault:
    """A fault the scenario injected, on the same clocks as the operations."""

    at_mono: float
    at_wall: datetime
    kind: str
    detail: str


class History:
    """Collects operations and faults of one run (one event loop, so no locking is needed)."""

    def __init__(self) -> None:
        self.operations: list[Operation] = []
        self.faults: list[Fault] = []
        self._ids = itertools.count(1)

    def invoke(
        self,
        *,
        client: str,
        command: str,
        resource: str,
        body: dict[str, Any],
        key: str,
        attempt: int = 1,
        copy: int = 0,
    ) -> Operation:
        """Record a request just before it is sent."""
        operation = Operation(
            id=next(self._ids),
            client=client,
            command=command,
            resource=resource,
            body=dict(body),
            key=key,
            attempt=attempt,
            copy=copy,
            invoked_mono=time.monotonic(),
            invoked_wall=datetime.now(UTC),
        )
        self.operations.append(operation)
        return operation

    def respond(self, operation: Operation, status: int, body: Any, *, replayed: bool) -> None:
        """Record an HTTP answer: 2xx ok, 5xx indeterminate, anything else a definite refusal."""
        operation.completed_mono = time.monotonic()
        operation.status = status
        operation.replayed = replayed
        if 200 <= status < 300:
            operation.outcome = Outcome.OK
            operation.response = body if isinstance(body, dict) else {"unexpected": body}
            return
        operation.code = body.get("code") if isinstance(body, dict) else None
        operation.outcome = Outcome.INDETERMINATE if status >= 500 else Outcome.FAILED

    def lose(self, operation: Operation, error: str) -> None:
        """Record a request that got no answer (timeout, refused or broken connection)."""
        operation.completed_mono = time.monotonic()
        operation.outcome = Outcome.INDETERMINATE
        operation.error = error

    def fault(self, kind: str, detail: str = "") -> Fault:
        injected = Fault(time.monotonic(), datetime.now(UTC), kind, detail)
        self.faults.append(injected)
        return injected

    @property
    def acked(self) -> list[Operation]:
        return [op for op in self.operations if op.ok]

    @property
    def refused(self) -> list[Operation]:
        return [op for op in self.operations if op.failed]

    @property
    def unknown(self) -> list[Operation]:
        return [op for op in self.operations if op.indeterminate]


# --------------------------------------------------------------------------------------------------
# What the checker reads from the database
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EventRecord:
    """One row of ``events``, reduced to what the checks need."""

    resource: str
    version: int
    event_type: str
    owner: str | None
    fencing_token: int | None
    expires_at: datetime | None
    recorded_at: datetime  # the database clock at the append
    metadata: Mapping[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str | None:
        value = self.metadata.get("idempotency_key")
        return None if value is None else str(value)

    @property
    def outage(self) -> Outage | None:
        """The outage this event extended the lease for (a LOCK_RENEWED by lockledger), else None."""
        if self.event_type != LOCK_RENEWED or self.metadata.get("command") != "extend":
            return None
        return Outage(
            datetime.fromisoformat(str(self.metadata["outage_from"])),
            datetime.fromisoformat(str(self.metadata["outage_to"])),
        )


@dataclass(frozen=True)
class Outage:
    """A gap in the service's beacon, as an extension event states it (database time)."""

    began: datetime
    ended: datetime


@dataclass(frozen=True)
class LockStateRecord:
    """One row of the inline ``lock_state`` projection."""

    resource: str
    version: int
    status: str
    owner: str | None
    fencing_token: int
    expires_at: datetime | None


@dataclass(frozen=True)
class Violation:
    kind: str
    resource: str | None
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} [{self.resource}]: {self.detail}"


# The event an acknowledged command must have appended, by command.
_PRIMARY_EVENT = {"acquire": LOCK_ACQUIRED, "renew": LOCK_RENEWED, "release": LOCK_RELEASED}
_ENDS = {LOCK_RELEASED, LOCK_FORCE_RELEASED, LOCK_EXPIRED}
_GRANTS = {LOCK_ACQUIRED, LOCK_RENEWED}


# --------------------------------------------------------------------------------------------------
# The checker
# --------------------------------------------------------------------------------------------------


def check(
    operations: Sequence[Operation],
    events: Sequence[EventRecord],
    lock_states: Sequence[LockStateRecord] | None = None,
) -> list[Violation]:
    """Every contract breach visible in ``events`` given what the clients were told; empty when none.

    ``events`` must be every event of the resources the operations touched (in any order). Kinds:

    - per stream: ``version_gap`` (versions not 1..n: an event lost), ``time_regression`` (recorded_at
      going back), ``token_regression`` / ``token_mismatch`` (a grant's fencing token not above every
      earlier one / not its stream version), ``acquired_while_held``, ``no_such_lease`` (a renew, release
      or expiry of a lease that is not the live one), ``resurrected`` (renewed or released at or after
      its deadline), ``expired_early``, and ``overlap``: two leases overlapping in database time, a lease
      lasting from its LOCK_ACQUIRED to its release, or to its last deadline if it lapsed or is still held;
    - after an outage (docs/semantics.md, "Outages"), read from the extension events themselves:
      ``bad_extension`` (a lease extended that was not live when the outage began, or by other than the
      outage's length) and ``lapsed_in_outage`` (a lease live when an outage began, not extended by it);
    - per Idempotency-Key: ``lost_ack`` (a 2xx whose command is not in the log), ``ack_mismatch`` (in the
      log, but not as acknowledged: type, resource, owner, token, deadline), ``duplicate`` (a key applied
      more than once), ``partial_command``, ``phantom`` (applied although every request was refused),
      ``unexpected_event`` (a key the load never sent);
    - ``real_time_order``: a command acknowledged before another was sent is logged after it;
    - ``projection``: a lock_state row disagreeing with its stream's last event.
    """
    streams: dict[str, list[EventRecord]] = defaultdict(list)
    for event in events:
        streams[event.resource].append(event)
    outages = {outage for event in events if (outage := event.outage) is not None}
    violations: list[Violation] = []
    for resource, stream in sorted(streams.items()):
        stream.sort(key=lambda e: e.version)
        violations += _check_stream(resource, stream)
        violations += _check_outages(resource, stream, outages)
    violations += _check_keys(operations, events)
    violations += _check_real_time_order(operations, events)
    if lock_states is not None:
        violations += _check_projection(streams, lock_states)
    return violations


@dataclass
class _Lease:
    token: int
    owner: str | None
    start: datetime
    deadline: datetime | None
    version: int
    end: datetime | None = None


def _check_stream(resource: str, stream: list[EventRecord]) -> list[Violation]:
    """One resource's log: contiguous versions, time order, a valid lease life cycle, increasing fencing
    tokens, and no two leases overlapping in database time."""
    found: list[Violation] = []

    def flag(kind: str, detail: str) -> None:
        found.append(Violation(kind, resource, detail))

    for expected, event in enumerate(stream, start=1):
        if event.version != expected:
            flag("version_gap", f"expected version {expected}, found {event.version} (an event is missing)")
            break
    for earlier, later in itertools.pairwise(stream):
        if later.recorded_at < earlier.recorded_at:
            flag(
                "time_regression",
                f"v{later.version} recorded at {later.recorded_at} before v{earlier.version}"
                f" at {earlier.recorded_at}",
            )

    leases: list[_Lease] = []
    current: _Lease | None = None
    last_token = 0
    for event in stream:
        label = f"v{event.version} {event.event_type}"
        if event.event_type == LOCK_ACQUIRED:
            if current is not None:
                flag("acquired_while_held", f"{label} while token {current.token} had no end event")
                current.end = current.deadline
            token = event.fencing_token if event.fencing_token is not None else -1
            if token <= last_token:
                flag("token_regression", f"{label} granted token {token} after token {last_token}")
            if token != event.version:
                flag("token_mismatch", f"{label} carries token {token}, not its stream version")
            last_token = max(last_token, token)
            current = _Lease(token, event.owner, event.recorded_at, event.expires_at, event.version)
            leases.append(current)
            continue
        if current is None or event.fencing_token != current.token or event.owner != current.owner:
            flag(
                "no_such_lease",
                f"{label} for token {event.fencing_token} of {event.owner}, but the live lease is"
                f" {None if current is None else (current.token, current.owner)}",
            )
            continue
        deadline = current.deadline
        if (outage := event.outage) is not None:
            if deadline is None or deadline <= outage.began:
                flag("bad_extension", f"{label}: deadline {deadline} had passed when the outage began")
            elif event.expires_at != deadline + (outage.ended - outage.began):
                flag("bad_extension", f"{label}: {deadline} moved to {event.expires_at}, not by the outage")
            current.deadline = event.expires_at
        elif event.event_type == LOCK_RENEWED:
            if deadline is not None and event.recorded_at >= deadline:
                flag("resurrected", f"{label} at {event.recorded_at}, after the deadline {deadline}")
            current.deadline = event.expires_at
        elif event.event_type == LOCK_EXPIRED:
            if deadline is not None and event.recorded_at < deadline:
                flag("expired_early", f"{label} at {event.recorded_at}, before the deadline {deadline}")
            current.end, current = deadline, None
        elif event.event_type in _ENDS:
            if event.event_type == LOCK_RELEASED and deadline is not None and event.recorded_at >= deadline:
                flag("resurrected", f"{label} at {event.recorded_at}, after the deadline {deadline}")
            current.end, current = event.recorded_at, None
        else:
            flag("unknown_event", label)
    if current is not None:
        current.end = current.deadline  # still held: it lasts until its deadline at the latest

    # Overlap by database time: each lease must start once every earlier one has ended.
    latest: _Lease | None = None
    for lease in leases:
        if latest is not None and latest.end is not None and lease.start < latest.end:
            flag(
                "overlap",
                f"token {lease.token} ({lease.owner}) from {lease.start} while token {latest.token}"
                f" ({latest.owner}) held until {latest.end}",
            )
        if lease.end is not None and (latest is None or latest.end is None or lease.end > latest.end):
            latest = lease
    return found


def _check_outages(resource: str, stream: list[EventRecord], outages: set[Outage]) -> list[Violation]:
    """Every lease live when an outage began (granted before it, deadline after it, not ended before it
    ended) is extended by that outage's extension event."""
    found: list[Violation] = []
    for outage in sorted(outages, key=lambda o: o.began):
        holder: EventRecord | None = None  # the last grant of the live lease before the outage ended
        extended = False
        for event in stream:
            if event.recorded_at >= outage.ended and event.outage != outage:
                break
            if event.outage == outage:
                extended = True
            elif event.event_type in _GRANTS:
                holder = event
            elif event.event_type in _ENDS:
                holder = None
        live = holder is not None and holder.expires_at is not None and holder.expires_at > outage.began
        if live and not extended:
            assert holder is not None
            found.append(
                Violation(
                    "lapsed_in_outage",
                    resource,
                    f"token {holder.fencing_token} with deadline {holder.expires_at} was live when the"
                    f" outage of {outage.began}..{outage.ended} began, and not extended by it",
                )
            )
    return found


def _check_keys(operations: Sequence[Operation], events: Sequence[EventRecord]) -> list[Violation]:
    """Idempotency and durability: every acknowledged command is in the log once, as acknowledged; no key
    was applied twice; nothing was applied that every attempt was told had been refused."""
    found: list[Violation] = []
    by_key: dict[str, list[EventRecord]] = defaultdict(list)
    for event in events:
        if event.key is not None:
            by_key[event.key].append(event)
    ops_by_key: dict[str, list[Operation]] = defaultdict(list)
    for op in operations:
        ops_by_key[op.key].append(op)

    for key, keyed in by_key.items():
        keyed.sort(key=lambda e: (e.resource, e.version))
        primaries = [e for e in keyed if e.event_type != LOCK_EXPIRED]
        if len(primaries) > 1:
            found.append(
                Violation(
                    "duplicate",
                    keyed[0].resource,
                    f"key {key} applied {len(primaries)} times: "
                    + ", ".join(f"{e.resource} v{e.version} {e.event_type}" for e in primaries),
                )
            )
        for event in keyed:
            if event.event_type == LOCK_EXPIRED and not any(
                p.resource == event.resource and p.version == event.version + 1 for p in primaries
            ):
                found.append(
                    Violation(
                        "partial_command",
                        event.resource,
                        f"key {key}: v{event.version} LOCK_EXPIRED not followed by its acquire",
                    )
                )
        if key not in ops_by_key:
            found.append(
                Violation("unexpected_event", keyed[0].resource, f"key {key} was never sent by the load")
            )

    for key, ops in ops_by_key.items():
        primaries = [e for e in by_key.get(key, []) if e.event_type != LOCK_EXPIRED]
        acked = [op for op in ops if op.ok]
        if primaries and not acked and all(op.failed for op in ops):
            found.append(
                Violation(
                    "phantom",
                    primaries[0].resource,
                    f"key {key} is in the log although all {len(ops)} requests were refused"
                    f" ({sorted({str(op.code) for op in ops})})",
                )
            )
        for op in acked:
            found += _match_ack(op, primaries)
    return found


def _match_ack(op: Operation, primaries: list[EventRecord]) -> list[Violation]:
    """An acknowledged request against the event its key appended."""
    if not primaries:
        return [
            Violation(
                "lost_ack",
                op.resource,
                f"{op.command} #{op.id} (key {op.key}) answered {op.status} but is not in the log",
            )
        ]
    event = primaries[0]
    response = op.response or {}
    problems = []
    if event.resource != op.resource:
        problems.append(f"event on {event.resource}")
    if event.event_type != _PRIMARY_EVENT.get(op.command):
        problems.append(f"event is {event.event_type}")
    if event.owner != op.body.get("owner") or response.get("owner") != event.owner:
        problems.append(f"owner {response.get('owner')} acked, {event.owner} logged")
    if response.get("fencing_token") != event.fencing_token:
        problems.append(f"token {response.get('fencing_token')} acked, {event.fencing_token} logged")
    if "fencing_token" in op.body and op.body["fencing_token"] != event.fencing_token:
        problems.append(f"token {op.body['fencing_token']} sent, {event.fencing_token} logged")
    if op.command != "release":
        acked_deadline = response.get("expires_at")
        parsed = datetime.fromisoformat(acked_deadline) if isinstance(acked_deadline, str) else None
        if parsed != event.expires_at:
            problems.append(f"deadline {acked_deadline} acked, {event.expires_at} logged")
    if not problems:
        return []
    return [
        Violation(
            "ack_mismatch",
            op.resource,
            f"{op.command} #{op.id} (key {op.key}, v{event.version}): " + "; ".join(problems),
        )
    ]


def _check_real_time_order(operations: Sequence[Operation], events: Sequence[EventRecord]) -> list[Violation]:
    """Linearizability of acknowledged commands per resource: if one command's answer arrived before
    another was sent, the log must order the first one earlier. Only answers that were not replays count
    (a replay's event was appended by an earlier request under the same key)."""
    version_of: dict[tuple[str, str], int] = {}
    for event in events:
        if event.key is not None and event.event_type != LOCK_EXPIRED:
            version_of[(event.resource, event.key)] = event.version
    per_resource: dict[str, list[tuple[int, Operation]]] = defaultdict(list)
    for op in operations:
        if op.ok and not op.replayed and op.completed_mono is not None:
            version = version_of.get((op.resource, op.key))
            if version is not None:
                per_resource[op.resource].append((version, op))
    found: list[Violation] = []
    for resource, ordered in per_resource.items():
        ordered.sort(key=lambda pair: pair[0])
        latest_start: tuple[float, int, Operation] | None = None
        for version, op in ordered:
            assert op.completed_mono is not None
            if latest_start is not None and op.completed_mono < latest_start[0]:
                found.append(
                    Violation(
                        "real_time_order",
                        resource,
                        f"#{op.id} {op.command} (v{version}) was answered before #{latest_start[2].id}"
                        f" {latest_start[2].command} (v{latest_start[1]}) was sent, yet is logged after it",
                    )
                )
            if latest_start is None or op.invoked_mono > latest_start[0]:
                latest_start = (op.invoked_mono, version, op)
    return found


def _check_projection(
    streams: Mapping[str, list[EventRecord]], lock_states: Sequence[LockStateRecord]
) -> list[Violation]:
    """The inline ``lock_state`` row agrees with its stream's last event."""
    found: list[Violation] = []
    rows = {row.resource: row for row in lock_states}
    for resource, stream in streams.items():
        row = rows.get(resource)
        last = stream[-1]
        if row is None:
            found.append(Violation("projection", resource, "no lock_state row"))
            continue
        held = last.event_type in _GRANTS
        expected: tuple[Any, ...] = (last.version, "held" if held else "free")
        actual: tuple[Any, ...] = (row.version, row.status)
        if held:
            expected += (last.owner, last.fencing_token, last.expires_at)
            actual += (row.owner, row.fencing_token, row.expires_at)
        if expected != actual:
            found.append(Violation("projection", resource, f"lock_state {actual}, log says {expected}"))
    return found


def observations(operations: Sequence[Operation], events: Sequence[EventRecord]) -> dict[str, int]:
    """Facts that break no rule but a client author should know, counted per run:

    - ``applied_unanswered``: commands in the log whose applying request got no 2xx (its answer was
      lost, or it timed out) -- why a client must retry under the same key rather than give up;
    - ``applied_despite_503``: those among them whose every unanswered request was a 503: the service
      said ``unavailable`` about a command it had in fact committed;
    - ``concurrent_split``: keys where two requests were in flight at once and one was refused while the
      other executed (docs/semantics.md says the second waits and gets the stored answer).
    """
    applied = {e.key for e in events if e.key is not None and e.event_type != LOCK_EXPIRED}
    by_key: dict[str, list[Operation]] = defaultdict(list)
    for op in operations:
        by_key[op.key].append(op)
    unanswered = despite_503 = split = 0
    for key, ops in by_key.items():
        if key in applied and not any(op.ok and not op.replayed for op in ops):
            unanswered += 1
            others = [op for op in ops if not op.ok]
            despite_503 += bool(others) and all(op.status == 503 for op in others)
        executed = [op for op in ops if op.ok and not op.replayed]
        refused = [op for op in ops if op.failed]
        split += any(
            a.invoked_mono < (b.completed_mono or 0.0) and b.invoked_mono < (a.completed_mono or 0.0)
            for a in executed
            for b in refused
        )
    return {
        "applied_unanswered": unanswered,
        "applied_despite_503": despite_503,
        "concurrent_split": split,
    }


# --------------------------------------------------------------------------------------------------
# The database half
# --------------------------------------------------------------------------------------------------

EVENTS_SQL = """
SELECT stream_id, stream_version, event_type, data::text AS data, metadata::text AS metadata, recorded_at
  FROM events
 WHERE starts_with(stream_id, $1::text)
 ORDER BY stream_id, stream_version
"""

LOCK_STATE_SQL = """
SELECT resource, version, status, owner, fencing_token, expires_at
  FROM lock_state
 WHERE starts_with(resource, $1::text)
"""


def event_from_row(row: Mapping[str, Any] | asyncpg.Record) -> EventRecord:
    data = json.loads(row["data"])
    expires_at = data.get("expires_at")
    return EventRecord(
        resource=row["stream_id"],
        version=row["stream_version"],
        event_type=row["event_type"],
        owner=data.get("owner"),
        fencing_token=data.get("fencing_token"),
        expires_at=datetime.fromisoformat(expires_at) if expires_at else None,
        recorded_at=row["recorded_at"],
        metadata=json.loads(row["metadata"]),
    )


@dataclass(frozen=True)
class Audit:
    """What the checker read and concluded."""

    events: list[EventRecord]
    chains: VerifyReport | None  # None when read through the API (``lockledger verify`` checks them)
    violations: list[Violation]


async def audit(conn: asyncpg.Connection, prefix: str, operations: Iterable[Operation]) -> Audit:
    """Read every event and lock_state row of the resources under ``prefix``, verify every hash chain in
    the database, and check the history against them."""
    # One snapshot for both reads: a reaper still running against the database (this scenario's server,
    # or another test's) may expire a lease between them, which would look like a projection ahead of
    # its log.
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        rows = await conn.fetch(EVENTS_SQL, prefix)
        state_rows = await conn.fetch(LOCK_STATE_SQL, prefix)
    events = [event_from_row(row) for row in rows]
    states = [
        LockStateRecord(
            r["resource"], r["version"], r["status"], r["owner"], r["fencing_token"], r["expires_at"]
        )
        for r in state_rows
    ]
    chains = await verify_chains(conn)
    violations = check(list(operations), events, states)
    if chains.broken is not None:
        link = chains.broken
        violations.append(Violation("broken_chain", link.stream_id, f"v{link.version}: {link.reason}"))
    return Audit(events, chains, violations)


async def audit_database(database_url: str, prefix: str, operations: Iterable[Operation]) -> Audit:
    """:func:`audit` over a fresh connection as the URL's own role (the schema owner), which may read
    every table, unlike the service role."""
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        return await audit(conn, prefix, operations)
    finally:
        await conn.close()


# --------------------------------------------------------------------------------------------------
# The HTTP half: the history as the API exports it
# --------------------------------------------------------------------------------------------------


def event_from_export(line: Mapping[str, Any]) -> EventRecord:
    """One line of the NDJSON export (GET /v1/events) as the checker's record."""
    data = line["data"]
    expires_at = data.get("expires_at")
    return EventRecord(
        resource=line["stream"],
        version=line["version"],
        event_type=line["type"],
        owner=data.get("owner"),
        fencing_token=data.get("fencing_token"),
        expires_at=datetime.fromisoformat(expires_at) if expires_at else None,
        recorded_at=datetime.fromisoformat(line["recorded_at"]),
        metadata=line.get("metadata") or {},
    )


async def read_export(client: httpx.AsyncClient, prefix: str) -> list[EventRecord]:
    """Every event of the resources under ``prefix``, through the API's export (one snapshot)."""
    response = await client.get("/v1/events", params={"prefix": prefix})
    response.raise_for_status()
    return [event_from_export(json.loads(line)) for line in response.text.splitlines() if line.strip()]


async def audit_http(base_url: str, prefix: str, history: History, settle_s: float = 30.0) -> Audit:
    """:func:`check` over the history as the API tells it, not as the database holds it: the export of
    every event under ``prefix`` (GET /v1/events, which may be served by a standby).

    A standby may lag, so first a *fence* goes through the API: one more acquire, under the prefix and
    recorded in ``history`` like any command, sent once the load has stopped. An export that shows it was
    read after every command acknowledged before it (a standby replays commits in order), so the export
    is read until it does. Chains and the projection are not checked here: ``lockledger verify`` proves
    the chains, and the projection is the implementation's business."""
    fence = f"{prefix}fence"
    key = str(uuid.uuid4())
    body = {"owner": "auditor", "ttl_ms": 1_000}
    async with httpx.AsyncClient(base_url=base_url, timeout=10.0) as client:
        deadline = time.monotonic() + settle_s
        while True:  # the fence itself may meet an outage's tail: retried under its key
            operation = history.invoke(
                client="auditor", command="acquire", resource=fence, body=body, key=key
            )
            try:
                response = await client.post(
                    f"/v1/locks/{fence}/acquire", json=body, headers={"Idempotency-Key": key}
                )
            except httpx.TransportError as error:
                history.lose(operation, type(error).__name__)
            else:
                replayed = response.headers.get("Idempotent-Replayed") == "true"
                history.respond(operation, response.status_code, response.json(), replayed=replayed)
                if operation.ok or operation.failed:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the fence acquire on {fence} was never answered")
            await asyncio.sleep(0.5)
        assert operation.ok, f"the fence acquire on {fence} was refused: {operation.code}"
        while True:
            events = await read_export(client, prefix)
            if any(event.key == key for event in events):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the export never showed the fence on {fence}")
            await asyncio.sleep(0.2)
    return Audit(events, None, check(history.operations, events))
