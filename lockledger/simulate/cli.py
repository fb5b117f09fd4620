"""`lockledger simulate`: the fleet simulator's command (``lockledger.simulate.fleet``).

It joins the `lockledger` command through the entry point group ``lockledger.cli``, declared by the
server's distribution, which carries the simulator; the SDK's own distribution has neither.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Annotated

import stamina.instrumentation
import typer
from rich.live import Live
from rich.table import Table
from rich.text import Text

from lockledger.cli import (
    DEFAULT_URL,
    Format,
    FormatOption,
    Token,
    Url,
    print_csv,
    print_json,
    print_table,
    reported,
    stderr,
)
from lockledger.simulate.fleet import Settings, Simulation, Summary

__all__ = ["register", "simulate"]


def register(app: typer.Typer) -> None:
    """Add ``simulate`` to the `lockledger` command."""
    app.command()(simulate)


_SIMULATION_ROWS = [
    ("operations", "requests sent, retries included"),
    ("grants", "new leases the server granted"),
    ("grants_checked", "grants acted on, checked against the invariants"),
    ("lock_held", "conflicts: acquires answered lock_held"),
    ("waits_timed_out", "conflicts: waits for a lock that timed out"),
    ("leases_lost", "leases found lost while acting under them"),
    ("crashes", "agents crashed mid-work, their leases left to the reaper"),
    ("dropped_responses", "answers lost after the server processed the command"),
    ("replayed_responses", "retries answered with the stored answer (Idempotent-Replayed)"),
    ("sagas_started", "pallet-to-zone sagas started"),
    ("sagas_completed", "... completed"),
    ("sagas_compensated", "... aborted after the pallet was put back"),
    ("sagas_failed", "... aborted with nothing to undo, or cut by an error"),
    ("sagas_recovered", "... left by a crash, finished by the agent's next life"),
    ("pallets_put_back", "compensations run (the pick undone)"),
    ("parked", "times an AGV parked in a zone, holding it"),
    ("routes_reserved", "routes whose zones were all granted in one reservation"),
    ("routes_refused", "reservations still held by others after the wait (the pallet put back)"),
    ("zones_left", "zones of a route released one by one as the AGV left them"),
    ("handoffs_given", "pallets' leases handed to a forklift"),
    ("handoffs_accepted", "... accepted by the forklift, lifted, released"),
    ("handoffs_declined", "... declined by the forklift"),
    ("giver_tokens_refused", "the giver's token tried after its hand-off, and refused"),
    ("charges", "plugs taken at charging bays (semaphore permits)"),
    ("inspections", "zones inspected under their read lock"),
    ("relayouts", "zones re-laid out under their write lock"),
    ("shared_checked", "shared-lock grants checked: never over a bay's plugs, never a reader with a writer"),
    ("most_plugs_in_use", "the most plugs of one bay seen in use at once (at most --plugs)"),
    ("most_inspectors_together", "the most inspectors seen in one zone at once"),
    ("errors", "units of work cut by an unexpected refusal or an unreachable server"),
    ("sagas_unfinished", "sagas still running or compensating past their lease deadline: must be 0"),
    ("violations", "invariant violations: must be 0"),
]


def _simulation_line(summary: Summary) -> str:
    conflicts = summary["lock_held"] + summary["waits_timed_out"]
    return (
        f"{summary['elapsed_s']:6.1f} s  {summary['operations']:,} operations  {summary['grants']:,} grants"
        f"  {conflicts:,} conflicts  {summary['crashes']:,} crashes  {summary['violations']:,} violations"
    )


def _print_simulation(summary: Summary) -> None:
    held = summary["violations"] == 0
    table = Table(
        title=f"{summary['agents']} AGVs, {summary['pallets']} pallets, {summary['zones']} zones,"
        f" {summary['bays']} bays of {summary['plugs']} plugs, {summary['elapsed_s']:.1f} s"
        f" (seed {summary['seed']})",
        caption="every invariant held" if held else "INVARIANTS VIOLATED",
    )
    for column in ("measure", "count", "what"):
        table.add_column(column, justify="right" if column == "count" else "left")
    for key, what in _SIMULATION_ROWS:
        style = "" if key not in ("violations", "sagas_unfinished") else "bold green" if held else "bold red"
        table.add_row(key, f"{summary[key]:,}", what, style=style)
    print_table(table)


def simulate(
    agents: Annotated[int, typer.Option("--agents", min=1, max=1000, help="Simulated AGVs.")] = 8,
    duration: Annotated[
        float, typer.Option("--duration", min=0.1, help="Seconds to run; then work at hand is finished.")
    ] = 30.0,
    pallets: Annotated[
        int | None, typer.Option(min=1, show_default=False, help="Pallets (default: agents / 2).")
    ] = None,
    zones: Annotated[
        int | None, typer.Option(min=1, show_default=False, help="Zones (default: agents / 3).")
    ] = None,
    prefix: Annotated[str, typer.Option(help="Resources and agents are named with it.")] = "sim:",
    seed: Annotated[int | None, typer.Option(show_default=False, help="Fixes every random choice.")] = None,
    ttl: Annotated[float, typer.Option(min=1.0, help="Lease length, seconds.")] = 2.0,
    saga_lease: Annotated[
        float,
        typer.Option(
            min=1.0, help="A saga's own lease, seconds; the server finishes an abandoned saga within two."
        ),
    ] = 3.0,
    crash_probability: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Chance that a unit of work ends in a crash.")
    ] = 0.05,
    drop_probability: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Chance that a command's answer is lost.")
    ] = 0.02,
    route_probability: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=1.0,
            help="Chance that a unit of work not parked is a reserved route and a hand-off, not a saga"
            " (0: sagas and parking only, as before).",
        ),
    ] = 0.5,
    decline_probability: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Chance that a forklift declines a hand-off.")
    ] = 0.2,
    charge_probability: Annotated[
        float,
        typer.Option(
            min=0.0, max=1.0, help="Chance that a unit of work not parked is a charge at a bay's plug."
        ),
    ] = 0.1,
    inspect_probability: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=1.0,
            help="Chance that a unit of work not parked nor charging inspects a zone (read lock) or,"
            " one time in three, re-lays it out (write lock).",
        ),
    ] = 0.1,
    bays: Annotated[
        int | None, typer.Option(min=1, show_default=False, help="Charging bays (default: agents / 8).")
    ] = None,
    plugs: Annotated[
        int, typer.Option(min=1, max=10_000, help="Plugs per bay: its semaphore's permits.")
    ] = 4,
    output: FormatOption = Format.TABLE,
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Drive simulated AGVs against a running server through the SDK: pallet-to-zone sagas, routes
    reserved all at once whose pallets are handed to forklifts, charges at bays of a few plugs
    (semaphores) and zone inspections and re-layouts (read and write locks), with contention, crashes and
    lost answers, checking the lock invariants as they go. Exit 1 on a violation.

    Best against a dev-mode server, where each AGV is its own owner, or with an admin token (then every
    lease is the token's, shared by all AGVs). Ctrl-C stops early (twice: at once) and still summarizes.
    """
    settings = Settings(
        agents=agents, duration=duration, pallets=pallets, zones=zones, prefix=prefix, seed=seed, ttl=ttl,
        saga_lease=saga_lease, crash_probability=crash_probability, drop_probability=drop_probability,
        route_probability=route_probability, decline_probability=decline_probability,
        charge_probability=charge_probability, inspect_probability=inspect_probability, bays=bays,
        plugs=plugs,
    )  # fmt: skip
    stamina.instrumentation.set_on_retry_hooks([])  # the simulation retries on purpose, and counts them
    live = Live(console=stderr, transient=True) if stderr.is_terminal else None

    def progress(summary: Summary) -> None:
        if live is not None:
            live.update(Text(_simulation_line(summary)))
        else:
            stderr.print(_simulation_line(summary), highlight=False)

    with reported(url), live or contextlib.nullcontext():
        simulation = Simulation(settings, url, token or None)
        summary = asyncio.run(simulation.run(progress, every=1.0 if live else 5.0, interruptible=True))
    if output is Format.JSON:
        print_json(summary)
    elif output is Format.CSV:
        print_csv(["measure", "count"], [[key, summary[key]] for key, _ in _SIMULATION_ROWS])
    else:
        _print_simulation(summary)
    for example in summary["violation_examples"]:
        typer.echo(f"lockledger: violation: {example}", err=True)
    if summary["violations"]:
        raise typer.Exit(1)
