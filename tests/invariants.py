"""The coordination invariants, checked on the event log alone (issue 35, item 6).

Reads ``events`` as the schema owner, in position order, and judges it without the service's code: no
decider, no ``evolve``, no event classes, only the event types as the log spells them. What it checks:

- **holders** (:func:`check_holders`): along each stream (versions 1..n, none lost, recorded in time
  order), the leases its events begin, renew, hand on and end; every renewal, end and hand-off names a
  lease that is held, none after its deadline (an outage extension excepted), no expiry before it, and
  the holders at every transition are admitted by the stream's :class:`Kind` (the mutex: never two; a
  shared lock: one exclusive grant alone, or shared grants within the limit they agreed on). Fencing
  tokens strictly increase per stream.
- **reservations** (:func:`check_reservations`): every reservation's grants were appended in one
  transaction (one ``tx_id``), with one deadline, and cover exactly the resources it asked for.
- **hand-offs taken up once** (:func:`check_take_ups`): an accept or decline follows a hand-off to
  the agent that sends it, and nothing else between.
- **FIFO** (:func:`check_fifo`): no grant overtakes a waiting acquire's ticket that came before it, was
  still live and was granted later. A hand-off is not a grant (it bypasses the queue by design) and a
  waiter that gave up or died is never granted under its ticket, so neither is flagged. A shared lock's
  reader (a shared grant without a limit) waits only for exclusive tickets: readers waiting together
  may be granted in any order, never ahead of a writer that queued before them.
- **acknowledged commands** (:func:`check_acknowledged`): every 2xx the agents saw has its events in the
  log, once, as answered.

A new kind of lock is a new :class:`Kind`: its event types and what each does to the holders, and which
holders may coexist; add it to ``KINDS``. The shared lock's streams are ``shared/<resource>``: the log
and queue readers take them under ``shared/<prefix>`` too.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

import asyncpg

from tests.faults.history import Operation, Violation

# --------------------------------------------------------------------------------------------------
# What the log holds
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogEvent:
    """One row of ``events``: where it stands, what it says, and the transaction that appended it."""

    position: int
    stream: str
    version: int
    type: str
    data: Mapping[str, Any]
    metadata: Mapping[str, Any]
    recorded_at: datetime
    tx_id: int

    @property
    def owner(self) -> str | None:
        value = self.data.get("owner")
        return None if value is None else str(value)

    @property
    def token(self) -> int | None:
        value = self.data.get("fencing_token")
        return None if value is None else int(value)

    @property
    def expires_at(self) -> datetime | None:
        value = self.data.get("expires_at")
        return None if value is None else datetime.fromisoformat(str(value))

    @property
    def key(self) -> str | None:
        value = self.metadata.get("idempotency_key")
        return None if value is None else str(value)

    @property
    def label(self) -> str:
        return f"#{self.position} v{self.version} {self.type}"


@dataclass(frozen=True)
class QueuedTicket:
    """A waiting acquire's ticket as ``lock_queue`` showed it: ``since`` is read by the inserting statement
    while it holds the lock's head row, so a grant recorded after ``since`` was decided with it queued."""

    ticket: int
    resource: str
    owner: str
    since: datetime
    deadline: datetime
    exclusive: bool = True  # waits for an exclusive grant (a mutex's always; a shared lock's reader's not)


# --------------------------------------------------------------------------------------------------
# Kinds of lock: what their events do to the holders
# --------------------------------------------------------------------------------------------------


class Effect(StrEnum):
    BEGIN = "begin"  # a lease begins: owner, token, deadline in the event
    RENEW = "renew"  # a held lease gets a new deadline
    END = "end"  # a held lease ends by its holder, before its deadline (released)
    EXPIRE = "expire"  # a held lease ends at its deadline, never before it
    FORCE_END = "force_end"  # a held lease ends at any time (an operator's force-release)
    HAND_ON = "hand_on"  # a held lease (from_owner, from_token) ends and the event's lease begins


@dataclass
class Hold:
    """A lease as the log has shown it so far."""

    owner: str | None
    token: int
    deadline: datetime | None
    grant: LogEvent  # the event that began it (a kind may read a mode or a limit from it)


@dataclass(frozen=True)
class Kind:
    """A kind of lock as its log shows it. ``breaks`` says which rule holders holding at once break (None:
    they may coexist): the mutex admits one; a shared lock readers, or one writer; a semaphore up to its
    limit."""

    name: str
    effects: Mapping[str, Effect]
    breaks: Callable[[Sequence[Hold]], str | None]


MUTEX = Kind(
    "mutex",
    {
        "LOCK_ACQUIRED": Effect.BEGIN,
        "LOCK_RENEWED": Effect.RENEW,
        "LOCK_RELEASED": Effect.END,
        "LOCK_EXPIRED": Effect.EXPIRE,
        "LOCK_FORCE_RELEASED": Effect.FORCE_END,
        "LOCK_HANDED_OFF": Effect.HAND_ON,
    },
    lambda holds: "two_holders" if len(holds) > 1 else None,
)


def _shared_breaks(holds: Sequence[Hold]) -> str | None:
    """A shared lock's grants (``SHARED_ACQUIRED``'s ``mode`` and ``limit``): an exclusive one alone;
    shared ones all naming one limit, and no more of them than it."""
    if len(holds) > 1 and any(h.grant.data.get("mode") == "exclusive" for h in holds):
        return "writer_not_alone"
    limits = {h.grant.data.get("limit") for h in holds}
    if len(limits) > 1:
        return "limit_mismatch"
    limit = next(iter(limits), None)
    return "over_limit" if limit is not None and len(holds) > int(limit) else None


SHARED = Kind(
    "shared lock",
    {
        "SHARED_ACQUIRED": Effect.BEGIN,
        "SHARED_RENEWED": Effect.RENEW,
        "SHARED_RELEASED": Effect.END,
        "SHARED_EXPIRED": Effect.EXPIRE,
    },
    _shared_breaks,
)
KINDS: tuple[Kind, ...] = (MUTEX, SHARED)
GRANTS = frozenset({"LOCK_ACQUIRED", "SHARED_ACQUIRED"})  # the events a queued acquire is served by
EXPIRIES = frozenset({"LOCK_EXPIRED", "SHARED_EXPIRED"})


def kind_of(stream: Sequence[LogEvent]) -> Kind | None:
    """The kind whose event types the stream's first event belongs to (None: a stream of no lock)."""
    return next((kind for kind in KINDS if stream[0].type in kind.effects), None)


# --------------------------------------------------------------------------------------------------
# The checks
# --------------------------------------------------------------------------------------------------


def streams_of(events: Iterable[LogEvent]) -> dict[str, list[LogEvent]]:
    streams: dict[str, list[LogEvent]] = defaultdict(list)
    for event in events:
        streams[event.stream].append(event)
    for stream in streams.values():
        stream.sort(key=lambda e: e.version)
    return streams


def _is_extension(event: LogEvent) -> bool:
    """An outage extension: lockledger renews a lease whose deadline passed while nobody could renew."""
    return event.metadata.get("command") == "extend"


class _Walk:
    """One stream walked in version order: the leases held after each event, and what broke a rule."""

    def __init__(self, resource: str, kind: Kind) -> None:
        self.resource = resource
        self.kind = kind
        self.holds: dict[int, Hold] = {}
        self.last_token = 0
        self.last: LogEvent | None = None
        self.found: list[Violation] = []

    def flag(self, what: str, detail: str) -> None:
        self.found.append(Violation(what, self.resource, detail))

    def step(self, event: LogEvent) -> None:
        expected = 1 if self.last is None else self.last.version + 1
        if event.version != expected:
            self.flag("version_gap", f"{event.label}: version {expected} expected (an event is missing)")
        if self.last is not None and event.recorded_at < self.last.recorded_at:
            self.flag("time_regression", f"{event.label} recorded before {self.last.label}")
        self.last = event
        effect = self.kind.effects.get(event.type)
        if effect is None:
            self.flag("unknown_event", f"{event.label} in a {self.kind.name} stream")
        elif effect is Effect.BEGIN:
            self.begin(event)
        elif effect is Effect.RENEW:
            if (hold := self.held(event.owner, event.token, event)) is not None:
                self.live_at(hold, event)
                hold.deadline = event.expires_at
        elif effect in (Effect.END, Effect.EXPIRE, Effect.FORCE_END):
            if (hold := self.held(event.owner, event.token, event)) is not None:
                if effect is Effect.EXPIRE:
                    if hold.deadline is not None and event.recorded_at < hold.deadline:
                        self.flag("expired_early", f"{event.label} before the deadline {hold.deadline}")
                elif effect is Effect.END:
                    self.live_at(hold, event)
                del self.holds[hold.token]
        else:
            giver = self.held(event.data.get("from_owner"), event.data.get("from_token"), event)
            if giver is not None:
                self.live_at(giver, event)
                del self.holds[giver.token]
            self.begin(event)

    def held(self, owner: str | None, token: int | None, event: LogEvent) -> Hold | None:
        hold = self.holds.get(token) if token is not None else None
        if hold is None or hold.owner != owner:
            self.flag("no_such_lease", f"{event.label} names ({owner}, {token}); held: {sorted(self.holds)}")
            return None
        return hold

    def begin(self, event: LogEvent) -> None:
        token = event.token if event.token is not None else -1
        if token <= self.last_token:
            self.flag("token_regression", f"{event.label} token {token} after {self.last_token}")
        self.last_token = max(self.last_token, token)
        self.holds[token] = Hold(event.owner, token, event.expires_at, event)
        if (broken := self.kind.breaks(list(self.holds.values()))) is not None:
            holders = [(h.owner, h.token, h.grant.data.get("mode")) for h in self.holds.values()]
            self.flag(broken, f"{event.label}: {self.kind.name} held by {holders} at once")

    def live_at(self, hold: Hold, event: LogEvent) -> None:
        """A renewal, release or hand-off must come before the lease's deadline (an outage extension
        comes after it by design)."""
        if hold.deadline is not None and event.recorded_at >= hold.deadline and not _is_extension(event):
            self.flag("resurrected", f"{event.label} at {event.recorded_at}, deadline {hold.deadline}")


def check_holders(events: Iterable[LogEvent]) -> list[Violation]:
    """Every stream's leases: a valid life cycle, holders its kind admits, tokens strictly increasing."""
    found: list[Violation] = []
    for resource, stream in sorted(streams_of(events).items()):
        kind = kind_of(stream)
        if kind is None:
            continue
        walk = _Walk(resource, kind)
        for event in stream:
            walk.step(event)
        found += walk.found
    return found


def check_reservations(
    events: Iterable[LogEvent], requested: Mapping[str, frozenset[str]]
) -> list[Violation]:
    """Each reservation's grants (``metadata.command = reserve``): one transaction, one instant and one
    deadline, exactly the resources it asked for (``requested``: reservation id -> resources), each once."""
    grants: dict[str, list[LogEvent]] = defaultdict(list)
    for event in events:
        if event.type == "LOCK_ACQUIRED" and event.metadata.get("command") == "reserve":
            grants[str(event.metadata.get("reservation_id"))].append(event)
    found: list[Violation] = []
    for rid, granted in sorted(grants.items()):
        streams = [e.stream for e in granted]
        if len({e.tx_id for e in granted}) != 1:
            txs = sorted({e.tx_id for e in granted})
            found.append(Violation("partial_reservation", rid, f"granted in transactions {txs}"))
        if len({(e.recorded_at, e.expires_at) for e in granted}) != 1:
            found.append(
                Violation("split_deadline", rid, "its leases were granted at several instants or deadlines")
            )
        if rid not in requested:
            found.append(Violation("unexpected_reservation", rid, f"granted {streams}, never asked for"))
        elif len(set(streams)) != len(streams) or set(streams) != requested[rid]:
            found.append(
                Violation("partial_reservation", rid, f"granted {streams}, asked {sorted(requested[rid])}")
            )
    return found


def check_take_ups(events: Iterable[LogEvent]) -> list[Violation]:
    """A hand-off is taken up once, by its receiver, before anything else befalls the lease: each accept
    (a renewal) or decline (a release) follows a ``LOCK_HANDED_OFF`` to the same agent, with nothing but
    outage extensions between."""
    found: list[Violation] = []
    for resource, stream in sorted(streams_of(events).items()):
        awaiting: str | None = None  # the receiver of the hand-off not yet taken up
        for event in stream:
            command = event.metadata.get("command")
            if command in ("accept", "decline"):
                if event.owner is None or event.owner != awaiting:
                    detail = f"{event.label} {command} by {event.owner}, awaiting {awaiting}"
                    found.append(Violation("bad_take_up", resource, detail))
                awaiting = None
            elif event.type == "LOCK_HANDED_OFF":
                awaiting = event.owner
            elif not _is_extension(event):
                awaiting = None
    return found


def _waits_only_for_writers(grant: LogEvent) -> bool:
    """A shared lock's reader: a shared grant without a limit waits only for exclusive tickets ahead of
    it (docs/decisions/0051-shared-locks.md); every other grant waits for every ticket ahead."""
    return (
        grant.type == "SHARED_ACQUIRED"
        and grant.data.get("mode") == "shared"
        and grant.data.get("limit") is None
    )


class _Queue:
    """The tickets each lock's queue showed, and when each granted ticket was served (the log's grants
    carry ``metadata.queue_ticket``)."""

    def __init__(self, events: Iterable[LogEvent], tickets: Iterable[QueuedTicket]) -> None:
        self.grants = [e for e in events if e.type in GRANTS]
        self.served: dict[int, datetime] = {}
        for grant in self.grants:
            if (number := grant.metadata.get("queue_ticket")) is not None:
                self.served[int(number)] = grant.recorded_at
        self.tickets: dict[str, list[QueuedTicket]] = defaultdict(list)
        for ticket in tickets:
            self.tickets[ticket.resource].append(ticket)

    def waiting_at(self, grant: LogEvent) -> list[QueuedTicket]:
        """The tickets of the grant's lock that waited when it was decided and were served after it:
        queued before it (``since``), live at it (``deadline``), granted later, so their waiters had
        neither given up nor died; for a reader's grant, only exclusive ones (the only ones it yields to)."""
        at = grant.recorded_at
        writers_only = _waits_only_for_writers(grant)
        return [
            t
            for t in self.tickets.get(grant.stream, [])
            if t.since < at < t.deadline
            and (served := self.served.get(t.ticket)) is not None
            and served > at
            and (t.exclusive or not writers_only)
        ]


def check_fifo(events: Iterable[LogEvent], tickets: Iterable[QueuedTicket]) -> list[Violation]:
    """No grant (a single acquire's, a reservation's or a shared lock's) while a ticket ahead of it waited:
    one that waited at the grant (``_Queue.waiting_at``: for a reader, an exclusive one) and is lower than
    the grant's own ticket, if it had one."""
    queue = _Queue(events, tickets)
    found: list[Violation] = []
    for grant in queue.grants:
        own = grant.metadata.get("queue_ticket")
        for waiting in queue.waiting_at(grant):
            if own is None or waiting.ticket < int(own):
                found.append(
                    Violation(
                        "overtaken",
                        grant.stream,
                        f"{grant.label} to {grant.owner} (ticket {own}) while ticket {waiting.ticket} of"
                        f" {waiting.owner}, queued since {waiting.since}, waited (served at"
                        f" {queue.served[waiting.ticket]})",
                    )
                )
    return found


def contested(events: Iterable[LogEvent], tickets: Iterable[QueuedTicket]) -> int:
    """How many grants were decided while other acquires it had to respect queued for the lock and were
    served later: what :func:`check_fifo` had to judge (a run with none proves nothing about the order)."""
    queue = _Queue(events, tickets)
    return sum(bool(queue.waiting_at(grant)) for grant in queue.grants)


# What an acknowledged command appended, per resource it names: the event type, and the answer's field
# that names the lease (a hand-off's and an accept's answers carry the receiver's token).
ACKNOWLEDGED_AS: dict[str, str] = {
    "acquire": "LOCK_ACQUIRED",
    "renew": "LOCK_RENEWED",
    "release": "LOCK_RELEASED",
    "handoff": "LOCK_HANDED_OFF",
    "accept": "LOCK_RENEWED",
    "decline": "LOCK_RELEASED",
    "reserve": "LOCK_ACQUIRED",
    "reserve-renew": "LOCK_RENEWED",
    "reserve-release": "LOCK_RELEASED",
    "shared-acquire": "SHARED_ACQUIRED",  # a shared command's resource is its stream, shared/<resource>
    "shared-renew": "SHARED_RENEWED",
    "shared-release": "SHARED_RELEASED",
}


def _acknowledged_leases(op: Operation) -> dict[str, int | None]:
    """The resources an acknowledged command acted on, each with the token the log must show (None:
    the answer did not say)."""
    answer = op.response or {}
    if op.command == "reserve":
        return {lease["resource"]: lease["fencing_token"] for lease in answer.get("leases", [])}
    if op.command.startswith("reserve-"):
        return {lease["resource"]: lease["fencing_token"] for lease in op.body["leases"]}
    return {op.resource: answer.get("fencing_token", op.body.get("fencing_token"))}


def check_acknowledged(operations: Iterable[Operation], events: Iterable[LogEvent]) -> list[Violation]:
    """Every command answered 2xx is in the log under its Idempotency-Key: one event of its type per
    resource, with the token it was answered; and no key was applied twice."""
    by_key: dict[str, list[LogEvent]] = defaultdict(list)
    for event in events:
        if event.key is not None and event.type not in EXPIRIES:  # an expiry a grant appended first
            by_key[event.key].append(event)
    found: list[Violation] = []
    checked: set[str] = set()
    for op in operations:
        if not op.ok or op.key in checked:
            continue
        checked.add(op.key)
        logged = by_key.get(op.key, [])
        leases = _acknowledged_leases(op)
        if not logged:
            found.append(
                Violation("lost_ack", op.resource, f"#{op.id} {op.command} {op.key}: not in the log")
            )
            continue
        expected = sorted((r, ACKNOWLEDGED_AS[op.command]) for r in leases)
        actual = sorted((e.stream, e.type) for e in logged)
        if actual != expected:
            found.append(Violation("ack_mismatch", op.resource, f"#{op.id} {op.command}: {actual}"))
            continue
        for event in logged:
            token = leases[event.stream]
            if token is not None and event.token != token:
                found.append(
                    Violation(
                        "ack_mismatch", event.stream, f"{event.label} token {event.token}, answered {token}"
                    )
                )
    return found


@dataclass(frozen=True)
class Judgement:
    """What the checker read and found."""

    events: list[LogEvent]
    violations: list[Violation] = field(default_factory=list)


def judge(
    events: Sequence[LogEvent],
    operations: Sequence[Operation],
    requested: Mapping[str, frozenset[str]],
    tickets: Iterable[QueuedTicket],
) -> Judgement:
    """Every check above over one log."""
    violations = [
        *check_holders(events),
        *check_reservations(events, requested),
        *check_take_ups(events),
        *check_fifo(events, tickets),
        *check_acknowledged(operations, events),
    ]
    return Judgement(list(events), violations)


# --------------------------------------------------------------------------------------------------
# Reading the log
# --------------------------------------------------------------------------------------------------

# Under a prefix: its mutexes' streams and queues, and its shared locks' (shared/<prefix>...).
LOG_SQL = """
SELECT position, stream_id, stream_version, event_type, data::text AS data, metadata::text AS metadata,
       recorded_at, tx_id::text AS tx_id
  FROM events
 WHERE starts_with(stream_id, $1::text) OR starts_with(stream_id, 'shared/' || $1::text)
 ORDER BY position
"""

QUEUE_SQL = """
SELECT ticket, resource, owner, since, deadline, exclusive FROM lock_queue
 WHERE starts_with(resource, $1::text) OR starts_with(resource, 'shared/' || $1::text)
"""


async def read_log(conn: asyncpg.Connection, prefix: str) -> list[LogEvent]:
    """Every event of the streams under ``prefix`` (and ``shared/<prefix>``), in position order."""
    rows = await conn.fetch(LOG_SQL, prefix)
    return [
        LogEvent(
            position=row["position"],
            stream=row["stream_id"],
            version=row["stream_version"],
            type=row["event_type"],
            data=json.loads(row["data"]),
            metadata=json.loads(row["metadata"]),
            recorded_at=row["recorded_at"],
            tx_id=int(row["tx_id"]),
        )
        for row in rows
    ]


async def read_queue(conn: asyncpg.Connection, prefix: str) -> list[QueuedTicket]:
    """The tickets in ``lock_queue`` now for the locks under ``prefix`` (and ``shared/<prefix>``)."""
    rows = await conn.fetch(QUEUE_SQL, prefix)
    return [
        QueuedTicket(
            row["ticket"], row["resource"], row["owner"], row["since"], row["deadline"], row["exclusive"]
        )
        for row in rows
    ]
