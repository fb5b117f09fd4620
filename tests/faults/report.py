"""One summary line per fault scenario, printed and, when ``LOCKLEDGER_FAULTS_REPORT`` names a file,
appended to it as JSON, so docs/reliability.md can quote measured numbers rather than hopes."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from tests.faults.history import Audit, History, audit_database, observations

REPORT_ENV = "LOCKLEDGER_FAULTS_REPORT"


@dataclass(frozen=True)
class ScenarioReport:
    scenario: str
    operations: int  # HTTP requests sent, retries and duplicates included
    acknowledged: int  # 2xx
    refused: int  # 4xx
    indeterminate: int  # timeouts, broken connections, 5xx
    indeterminate_kinds: dict[str, int]  # by HTTP status, or by transport error
    replayed: int  # 2xx with Idempotent-Replayed: true
    faults: int
    fault_kinds: dict[str, int]
    events: int  # events of the scenario's resources in the log
    violations: int
    duration_s: float
    observed: dict[str, int] = field(default_factory=dict)  # history.observations()
    notes: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        return (
            f"{self.scenario}: {self.operations} ops, {self.acknowledged} acked, {self.refused} refused,"
            f" {self.indeterminate} indeterminate {self.indeterminate_kinds}, {self.replayed} replayed;"
            f" {self.faults} faults"
            f" {self.fault_kinds}; {self.events} events; {self.violations} violations;"
            f" {self.duration_s:.1f} s; {self.observed}; {self.notes}"
        )


def summarize(
    scenario: str, history: History, audit: Audit, duration_s: float, **notes: Any
) -> ScenarioReport:
    return ScenarioReport(
        scenario=scenario,
        operations=len(history.operations),
        acknowledged=len(history.acked),
        refused=len(history.refused),
        indeterminate=len(history.unknown),
        indeterminate_kinds=dict(
            Counter(str(op.status) if op.status else (op.error or "no answer") for op in history.unknown)
        ),
        replayed=sum(op.replayed for op in history.acked),
        faults=len(history.faults),
        fault_kinds=dict(Counter(fault.kind for fault in history.faults)),
        events=len(audit.events),
        violations=len(audit.violations),
        duration_s=round(duration_s, 2),
        observed=observations(history.operations, audit.events),
        notes=notes,
    )


def publish(report: ScenarioReport) -> None:
    print(f"\n{report.line()}")
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(asdict(report), sort_keys=True) + "\n")


async def conclude(
    scenario: str,
    database_url: str,
    prefix: str,
    history: History,
    started_mono: float,
    notes_from: Callable[[Audit], dict[str, Any]] | None = None,
    audit_with: Callable[[], Awaitable[Audit]] | None = None,
    **notes: Any,
) -> Audit:
    """Audit the log against the history, publish the scenario's line (with ``notes`` and whatever
    ``notes_from`` finds in the audit), and return the audit for the scenario to assert on. The log is
    read from ``database_url`` unless ``audit_with`` reads it otherwise (history.audit_http: through the
    API)."""
    if audit_with is not None:
        audit = await audit_with()
    else:
        audit = await audit_database(database_url, prefix, history.operations)
    if notes_from is not None:
        notes.update(notes_from(audit))
    publish(summarize(scenario, history, audit, time.monotonic() - started_mono, **notes))
    for violation in audit.violations[:50]:
        print(f"  VIOLATION {violation}")
    return audit
