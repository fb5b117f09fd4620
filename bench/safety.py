"""The hot mode's safety check: one holder at a time per resource, fencing tokens strictly increasing.

Every grant is recorded with the client's monotonic clock: when the acquire response arrived and when the
release was sent. If the service really serialized the two leases, B's grant response cannot arrive before
A's release was even sent; so ``B.acquired_at < A.release_sent_at`` proves an overlap. Both instants are
taken on the client side of the wire (after the response, before the request), so the check never reports
an overlap that did not happen, whatever the network and thread hand-off delays.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Grant:
    resource: str
    token: Any
    acquired_at: float
    release_sent_at: float


@dataclass
class SafetyReport:
    grants: int = 0
    overlaps: int = 0
    token_regressions: int = 0
    examples: list[str] = field(default_factory=list)

    @property
    def violations(self) -> int:
        return self.overlaps + self.token_regressions


def check_grants(grants: list[Grant], *, monotonic_tokens: bool, max_examples: int = 5) -> SafetyReport:
    report = SafetyReport(grants=len(grants))
    by_resource: dict[str, list[Grant]] = defaultdict(list)
    for grant in grants:
        by_resource[grant.resource].append(grant)
    for resource, held in by_resource.items():
        held.sort(key=lambda g: g.acquired_at)
        holder = held[0]  # the grant whose hold ends last so far
        previous = held[0]
        for grant in held[1:]:
            if grant.acquired_at < holder.release_sent_at:
                report.overlaps += 1
                if len(report.examples) < max_examples:
                    report.examples.append(
                        f"{resource}: token {grant.token} granted "
                        f"{(holder.release_sent_at - grant.acquired_at) * 1e3:.3f} ms before token "
                        f"{holder.token} was released"
                    )
            if monotonic_tokens and not grant.token > previous.token:
                report.token_regressions += 1
                if len(report.examples) < max_examples:
                    report.examples.append(
                        f"{resource}: token {grant.token} granted after token {previous.token}"
                    )
            if grant.release_sent_at > holder.release_sent_at:
                holder = grant
            previous = grant
    return report
