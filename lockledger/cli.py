"""The `lockledger` command: the investigator's commands (replay, history, export) over the HTTP API, and
the commands other installed distributions add (the server's serve, migrate, tokens...; the fleet
simulator's simulate, ``lockledger.simulate.cli``, which the server's distribution carries).

Those join through the entry point group ``lockledger.cli``: each entry is a function taking this typer
app and adding its commands to it. So the server can bring its commands without the SDK importing
server code, and an SDK installed alone (``pip install 'lockledger[cli]'``) has the client commands only.
Typer and rich come with the ``cli`` extra, for this module alone; the rest of the SDK never needs them.

Errors the server or the network report end the command with one line on stderr and status 1 (2 for
an argument refused before anything is sent), never a traceback.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from enum import StrEnum
from importlib.metadata import entry_points
from typing import Annotated, Any, overload

try:
    import typer
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import Progress, ProgressColumn, SpinnerColumn, Task, TextColumn, TimeElapsedColumn
    from rich.table import Table
    from rich.text import Text
except ModuleNotFoundError as missing:  # the SDK installed without its `cli` extra
    raise SystemExit(
        f"lockledger: the command line needs the cli extra: pip install 'lockledger[cli]' ({missing})"
    ) from None

import httpx
import stamina.instrumentation

from lockledger.client import Client
from lockledger.errors import LockLedgerError, Unavailable, ValidationError
from lockledger.event import Event
from lockledger.replay import instant
from lockledger_breaker import CircuitOpen

ENTRY_POINT_GROUP = "lockledger.cli"
URL_ENV = "LOCKLEDGER_URL"
TOKEN_ENV = "LOCKLEDGER_TOKEN"

app = typer.Typer(no_args_is_help=True, help="lockledger: leases with fencing tokens, on an event log.")
stderr = Console(stderr=True, soft_wrap=True)


class Format(StrEnum):
    TABLE = "table"
    JSON = "json"
    CSV = "csv"


Url = Annotated[
    str, typer.Option("--url", envvar=URL_ENV, help="The lockledger server's base URL.")
]  # fmt: skip
Token = Annotated[
    str | None,
    typer.Option(
        "--token", envvar=TOKEN_ENV, show_default=False, help="API token of an investigator (or an admin)."
    ),
]
FormatOption = Annotated[Format, typer.Option("--format", help="table (for a terminal), json or csv.")]
Prefix = Annotated[str | None, typer.Option(help="Only resources starting with this.")]
Owner = Annotated[str | None, typer.Option(help="Only this agent's leases and events.")]
From = Annotated[
    str | None, typer.Option("--from", help="From this instant (RFC 3339 with an offset), included.")
]
To = Annotated[
    str | None, typer.Option("--to", help="Up to this instant (RFC 3339 with an offset), excluded.")
]
DEFAULT_URL = "http://127.0.0.1:8000"
_PAGE = 1000


# --- errors: one line, never a traceback ---------------------------------------------------------------


def _fail(message: str, status: int = 1) -> typer.Exit:
    typer.echo(f"lockledger: {' '.join(message.split())}", err=True)  # one line, whatever the detail holds
    return typer.Exit(status)


def _explain(error: LockLedgerError, url: str) -> str:
    if isinstance(error, Unavailable) and error.status == 0:
        cause = error.__cause__
        why = f"{type(cause).__name__}: {cause}" if cause is not None else error.detail
        return f"cannot reach the server at {url} ({why})"
    hint = {
        401: f"; pass an investigator's token with --token or {TOKEN_ENV}",
        403: "; replay, history and export need an investigator or admin token",
    }.get(error.status, "")
    return f"{error.status} {error.code}: {error.detail}{hint}"


@contextlib.contextmanager
def reported(url: str) -> Iterator[None]:
    """The SDK's and the network's errors as one line on stderr and a non-zero exit."""
    try:
        yield
    except ValidationError as error:
        if error.status == 0:  # refused before sending: a bad argument
            raise _fail(error.detail, 2) from None
        raise _fail(_explain(error, url)) from None
    except LockLedgerError as error:
        raise _fail(_explain(error, url)) from None
    except CircuitOpen:
        raise _fail(f"the server at {url} keeps failing; not trying again for now") from None
    except httpx.InvalidURL as error:
        raise _fail(f"invalid --url {url!r}: {error}", 2) from None


def _client(url: str, token: str | None) -> Client:
    # stamina logs each retry (through structlog, to stdout, when that is installed): a command's stdout
    # is its answer (`export > events.ndjson`), and a failure is reported once, in one line.
    stamina.instrumentation.set_on_retry_hooks([])
    try:
        return Client(url, token=token or None, retry_attempts=3, retry_timeout=5.0)
    except httpx.InvalidURL as error:
        raise _fail(f"invalid --url {url!r}: {error}", 2) from None


def _instant(option: str, value: str | None) -> str | None:
    """The instant as the server's text, or a one-line usage error naming the option."""
    if value is None:
        return None
    try:
        return instant(option, value)
    except ValidationError as error:
        raise _fail(error.detail, 2) from None


# --- rendering -----------------------------------------------------------------------------------------


@overload
def _wire(value: datetime) -> str: ...
@overload
def _wire(value: datetime | None) -> str | None: ...
def _wire(value: datetime | None) -> str | None:
    """An instant as the API writes it (UTC, microseconds, Z): json and csv keep the server's shape."""
    if value is None:
        return None
    return value.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _clock(value: datetime, with_date: bool = True) -> str:
    shown = f"{value:%H:%M:%S}.{value.microsecond // 1000:03d}"
    return f"{value:%Y-%m-%d} {shown}" if with_date else shown


def _shown(value: datetime | None) -> Text:
    """An instant for a person, in three short lines: the date, the time in UTC, and the same instant in
    this machine's zone (with its date if that is another day)."""
    if value is None:
        return Text("")
    utc, local = value.astimezone(UTC), value.astimezone()
    text = Text(f"{utc:%Y-%m-%d}\n{_clock(utc, False)} UTC")
    text.append(f"\n{_clock(local, local.date() != utc.date())} {local:%Z}", style="dim")
    return text


def _inline(value: datetime) -> str:
    utc, local = value.astimezone(UTC), value.astimezone()
    return f"{utc:%Y-%m-%d %H:%M:%S} UTC ({local:%Y-%m-%d %H:%M:%S %Z} local)"


# Numbers stay on one line and times keep a line's width (see _shown); every other column folds when the
# terminal is narrow, rather than cutting a value short.
_NUMBERS = {"position", "version", "token"}
_TIMES = {"acquired", "expires", "recorded"}


def _table(*columns: str, title: str, caption: str) -> Table:
    table = Table(title=title, caption=caption)
    for column in columns:
        table.add_column(
            column,
            overflow="fold",
            no_wrap=column in _NUMBERS,
            justify="right" if column in _NUMBERS else "left",
            min_width=16 if column in _TIMES else None,
        )
    return table


def print_json(document: Any) -> None:
    sys.stdout.write(json.dumps(document, indent=2) + "\n")


def print_csv(header: list[str], rows: list[list[Any]]) -> None:
    writer = csv.writer(sys.stdout, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)


def print_table(table: Table) -> None:
    Console(soft_wrap=False).print(table)


# --- replay --------------------------------------------------------------------------------------------


@app.command()
def replay(
    at: Annotated[
        str,
        typer.Option(
            "--at", help="The past instant, RFC 3339 with an offset: 2026-05-05T09:30:00Z, ...+02:00."
        ),
    ],
    prefix: Prefix = None,
    owner: Owner = None,
    output: FormatOption = Format.TABLE,
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Every lease that was live at an instant, by resource: who held what, with which fencing token."""
    when = _instant("--at", at)
    assert when is not None
    with reported(url), _client(url, token) as client:
        state = client.replay_state(when, prefix=prefix, owner=owner)
    if output is Format.JSON:
        locks = [
            {"resource": lease.resource, "owner": lease.owner, "fencing_token": lease.fencing_token,
             "acquired_at": _wire(lease.acquired_at), "expires_at": _wire(lease.expires_at),
             "reservation_id": lease.reservation_id, "mode": lease.mode, "limit": lease.limit}
            for lease in state.locks
        ]  # fmt: skip
        print_json({"at": _wire(state.at), "position": state.position, "locks": locks})
    elif output is Format.CSV:
        rows = [
            [lease.resource, lease.owner, lease.fencing_token, _wire(lease.acquired_at),
             _wire(lease.expires_at), lease.reservation_id or "", lease.mode or "",
             "" if lease.limit is None else lease.limit]
            for lease in state.locks
        ]  # fmt: skip
        print_csv(_REPLAY_FIELDS, rows)
    else:
        table = _table(
            "resource", "lock", "owner", "token", "acquired", "expires", "reservation",
            title=f"Leases live at {_inline(state.at)}",
            caption=f"{len(state.locks)} lease(s); the log up to position {state.position}",
        )  # fmt: skip
        for lease in state.locks:
            table.add_row(
                escape(lease.resource), _lock_kind(lease.mode, lease.limit), escape(lease.owner),
                str(lease.fencing_token), _shown(lease.acquired_at), _shown(lease.expires_at),
                escape(lease.reservation_id or ""),
            )  # fmt: skip
        print_table(table)


_REPLAY_FIELDS = [
    "resource", "owner", "fencing_token", "acquired_at", "expires_at", "reservation_id", "mode", "limit",
]  # fmt: skip


def _lock_kind(mode: str | None, limit: int | None) -> str:
    """What a lease holds, for a person: ``mutex``; a read/write lock's ``read`` or ``write``; a
    semaphore's ``permit of N``, or ``all N permits`` for an exclusive grant of it."""
    if mode is None:
        return "mutex"
    if limit is None:
        return "read" if mode == "shared" else "write"
    return f"permit of {limit}" if mode == "shared" else f"all {limit} permits"


# --- history -------------------------------------------------------------------------------------------

_HISTORY_FIELDS = ["position", "resource", "version", "event_id", "type", "owner", "fencing_token",
                   "recorded_at", "data", "metadata"]  # fmt: skip


def _row(event: Event) -> dict[str, Any]:
    """The fields a history row shows of an event."""
    names = ("position", "resource", "version", "event_id", "type", "data", "metadata", "recorded_at")
    return {name: getattr(event, name) for name in names}


def _history_rows(
    client: Client,
    resource: str | None,
    agent: str | None,
    start: str | None,
    end: str | None,
    shared: bool,
) -> list[dict[str, Any]]:
    """Every event of the resource's (its shared lock's, if ``shared``) or the agent's history in the
    range, following the pages."""
    rows: list[dict[str, Any]] = []
    if resource is not None:
        version = 0
        while True:
            page = client.history(resource, version, _PAGE, from_=start, to=end, shared=shared)
            rows += [_row(e) for e in page.events]
            if page.next_after_version is None or not page.events:
                return rows
            version = page.next_after_version
    assert agent is not None
    position = 0
    while True:
        agent_page = client.agent_history(agent, from_=start, to=end, after_position=position, limit=_PAGE)
        rows += [_row(e) for e in agent_page.events]
        if agent_page.next_after_position is None or not agent_page.events:
            return rows
        position = agent_page.next_after_position


# What a hand-off's receiver did, as the command in the event's metadata names it.
_TAKEN_UP = {"accept": "accepted the hand-off", "decline": "declined the hand-off"}


def _event(
    kind: str, data: dict[str, Any], metadata: dict[str, Any], recorded_at: datetime, grant: str | None = None
) -> Text:
    """An event for a person: its type, then what it says beyond who and which token: a shared-lock
    grant's mode and limit (on its renewals, release and expiry, the kind of ``grant`` it was), the TTL
    (for a hand-off, the time given to accept), the lease deadline (its date only if it is not the day the
    event was recorded), the reason, the giver of a hand-off, and the reservation the event belongs to."""
    text = Text(kind, style="bold")
    lines = []
    if (mode := data.get("mode")) is not None:  # a shared-lock grant (SHARED_ACQUIRED)
        limit = data.get("limit")
        lines.append(f"{mode} grant: {_lock_kind(str(mode), None if limit is None else int(limit))}")
        lines.append(f"limit {'none' if limit is None else limit}")
    elif grant is not None:
        lines.append(f"of the {grant} grant")
    if (giver := data.get("from_owner")) is not None:  # a hand-off: the lease it ended, the one it began
        lines.append(f"from {giver} (token {data.get('from_token')}) to {data.get('owner')}")
        if (ttl := data.get("ttl_ms")) is not None:
            lines.append(f"to accept within {int(ttl) / 1000:g} s")
    elif (ttl := data.get("ttl_ms")) is not None:
        lines.append(f"ttl {int(ttl) / 1000:g} s")
    if (taken := _TAKEN_UP.get(str(metadata.get("command")))) is not None:
        lines.append(taken)
    if (deadline := data.get("expires_at")) is not None:
        with contextlib.suppress(ValueError):
            when = datetime.fromisoformat(str(deadline).replace("Z", "+00:00"))
            utc, local = when.astimezone(UTC), when.astimezone()
            dated = utc.date() != recorded_at.astimezone(UTC).date()
            lines += [f"deadline {_clock(utc, dated)} UTC", f"({_clock(local, dated)} {local:%Z})"]
    if (reason := data.get("reason")) is not None:
        lines.append(f"reason: {reason}")
    if (reservation := metadata.get("reservation_id")) is not None:
        lines.append(f"reservation {reservation}")
    for line in lines:
        text.append(f"\n{line}", style="dim")
    return text


@app.command()
def history(
    resource: Annotated[str | None, typer.Argument(help="The resource whose history to show.")] = None,
    agent: Annotated[
        str | None, typer.Option("--agent", help="Show this agent's history (every resource) instead.")
    ] = None,
    shared: Annotated[
        bool, typer.Option("--shared", help="RESOURCE's shared lock (its grants) instead of its mutex.")
    ] = False,
    from_: From = None,
    to: To = None,
    output: FormatOption = Format.TABLE,
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """The events of one resource (RESOURCE, its shared lock's with --shared) or of one agent
    (--agent OWNER), oldest first."""
    if (resource is None) == (agent is None):
        raise _fail("name a RESOURCE or an --agent OWNER (one of them)", 2)
    if shared and resource is None:
        raise _fail("--shared is for a RESOURCE's history, not an agent's", 2)
    start, end = _instant("--from", from_), _instant("--to", to)
    with reported(url), _client(url, token) as client:
        rows = _history_rows(client, resource, agent, start, end, shared)
    if output is Format.JSON:
        key, subject = ("resource", resource) if resource is not None else ("owner", agent)
        events = [{**row, "recorded_at": _wire(row["recorded_at"])} for row in rows]
        print_json({key: subject, "events": events})
        return
    if output is Format.CSV:
        lines = [
            [row["position"], row["resource"], row["version"], row["event_id"], row["type"],
             row["data"].get("owner"), row["data"].get("fencing_token"), _wire(row["recorded_at"]),
             json.dumps(row["data"]), json.dumps(row["metadata"])]
            for row in rows
        ]  # fmt: skip
        print_csv(_HISTORY_FIELDS, lines)
        return
    subject = (
        f"{'shared lock' if shared else 'resource'} {resource}" if resource is not None else f"agent {agent}"
    )
    span = "".join(
        [f" from {_inline(datetime.fromisoformat(start))}" if start else "",
         f" to {_inline(datetime.fromisoformat(end))}" if end else ""]
    )  # fmt: skip
    # The subject is in the title: a resource's history needs no resource column, an agent's no owner
    # (and its events are in log order: the position says all the version would).
    columns = ["position", "version", "owner"] if resource is not None else ["position", "resource"]
    table = _table(
        *columns, "event", "token", "recorded",
        title=f"History of {escape(subject)}{span}", caption=f"{len(rows)} event(s)",
    )  # fmt: skip
    grants: dict[tuple[str, object], str] = {}  # a shared grant's kind by stream and token, once acquired
    for row in rows:
        data = row["data"]
        grant = (row["resource"], data.get("fencing_token"))
        if row["type"] == "SHARED_ACQUIRED":
            limit = data.get("limit")
            grants[grant] = _lock_kind(str(data.get("mode")), None if limit is None else int(limit))
        if resource is not None:
            cells = [str(row["position"]), str(row["version"]), escape(str(data.get("owner", "")))]
        else:
            cells = [str(row["position"]), escape(row["resource"])]
        event = _event(row["type"], data, row["metadata"], row["recorded_at"], grants.get(grant))
        table.add_row(*cells, event, str(data.get("fencing_token", "")), _shown(row["recorded_at"]))
    print_table(table)


# --- export --------------------------------------------------------------------------------------------


class _Rate(ProgressColumn):
    """Events per second, over the last few seconds."""

    def render(self, task: Task) -> Text:
        speed = task.speed
        return Text("" if speed is None else f"{speed:,.0f} events/s", style="cyan")


@app.command()
def export(
    from_: From = None,
    to: To = None,
    event_type: Annotated[
        str | None, typer.Option("--type", help="Only events of this type (LOCK_ACQUIRED, ...).")
    ] = None,
    owner: Owner = None,
    prefix: Prefix = None,
    after_position: Annotated[
        int, typer.Option("--after-position", min=0, help="Only events after this log position (resume).")
    ] = 0,
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Write the event log as NDJSON to stdout (`> events.ndjson`), one event a line, in log order.

    Lines are the server's, unchanged (hashes included). Progress goes to stderr; if the export stops,
    --after-position with the last position written resumes it.
    """
    start, end = _instant("--from", from_), _instant("--to", to)
    progress = Progress(
        SpinnerColumn(), TextColumn("exported {task.completed:,.0f} events"), _Rate(), TimeElapsedColumn(),
        console=stderr, transient=True,
    )  # fmt: skip
    out = sys.stdout
    written, last, began = 0, after_position, time.monotonic()
    try:
        with reported(url), _client(url, token) as client, progress:
            task = progress.add_task("export", total=None)
            events = client.export(
                from_=start, to=end, after_position=after_position, type=event_type, owner=owner,
                prefix=prefix,
            )  # fmt: skip
            for event in events:
                assert event.line is not None  # the export sends every event as a line
                out.write(event.line + "\n")
                written, last = written + 1, event.position
                if written % 100 == 0:
                    progress.update(task, completed=written)
            out.flush()
    except BrokenPipeError:  # the reader stopped reading (`| head`): nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())  # so the final flush finds no broken pipe
        raise typer.Exit(1) from None
    except typer.Exit:
        if written:
            typer.echo(
                f"lockledger: stopped after position {last} (--after-position {last} resumes)", err=True
            )
        raise
    except KeyboardInterrupt:
        out.flush()
        raise _fail(f"interrupted after position {last}; --after-position {last} resumes", 130) from None
    elapsed = max(time.monotonic() - began, 1e-9)
    stderr.print(
        f"exported {written:,} events" + (f" (positions up to {last})" if written else "")
        + f" in {elapsed:.1f} s, {written / elapsed:,.0f} events/s",
        highlight=False,
    )  # fmt: skip


# --- one `lockledger` command for every installed part -------------------------------------------------


def register_installed(target: typer.Typer, group: str = ENTRY_POINT_GROUP) -> list[str]:
    """Let every entry point of ``group`` add its commands to ``target``; the names of those that could
    not (a warning each on stderr: the other commands keep working)."""
    failed = []
    for entry in entry_points(group=group):
        try:
            register: Callable[[typer.Typer], None] = entry.load()
            register(target)
        except Exception as error:
            failed.append(entry.name)
            typer.echo(
                f"lockledger: the {entry.name} commands ({entry.value}) could not be loaded:"
                f" {type(error).__name__}: {error}",
                err=True,
            )
    return failed


def main() -> None:
    """The `lockledger` console script: the client commands and every installed distribution's."""
    register_installed(app)
    app()


if __name__ == "__main__":
    main()
