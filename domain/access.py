"""Who may do what: the roles of an API token and the actions each one allows.

A pure policy table, so the HTTP layer, the CLI and the tests all ask the same question the same way.
Roles are deliberately few and disjoint in purpose: an agent's token leaking lets someone hold locks as
that agent, never end other agents' leases or read the fleet's history.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Role(StrEnum):
    AGENT = "agent"  # acquire, renew and release its own leases
    DASHBOARD = "dashboard"  # read the current lock state
    INVESTIGATOR = "investigator"  # read state and the event history (replay, export, verify)
    ADMIN = "admin"  # everything, including force-release and API tokens


class Action(StrEnum):
    HOLD = "hold"  # acquire, renew, release: the lease owner is the caller
    FORCE_RELEASE = "force_release"
    READ_STATE = "read_state"
    READ_HISTORY = "read_history"
    MANAGE_TOKENS = "manage_tokens"
    # Sagas take the same roles as the lock actions they group, so the role table keeps its meaning:
    # whoever may hold locks may drive a saga (its own: the API checks the owner), whoever may read the
    # lock state may read sagas. Aliases, not new members.
    DRIVE_SAGA = "hold"
    READ_SAGAS = "read_state"
    # The change feed (GET /v1/events/stream) follows what the lock state is made of, as it changes: the
    # roles that read the state (dashboard, investigator, admin) may follow it.
    READ_FEED = "read_state"


_ALLOWED: dict[Role, frozenset[Action]] = {
    Role.AGENT: frozenset({Action.HOLD}),
    Role.DASHBOARD: frozenset({Action.READ_STATE}),
    Role.INVESTIGATOR: frozenset({Action.READ_STATE, Action.READ_HISTORY}),
    Role.ADMIN: frozenset(Action),
}


def allows(role: Role, action: Action) -> bool:
    return action in _ALLOWED[role]


def roles_allowed(action: Action) -> list[Role]:
    """The roles that may perform ``action``, for error messages and docs."""
    return [role for role in Role if allows(role, action)]


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller: a token's name (the lease owner for agents) and role.

    ``authenticated`` is false only in dev mode, where nobody is checked and owners come from the body.
    """

    name: str
    role: Role
    authenticated: bool = True


DEV_PRINCIPAL = Principal("anonymous", Role.ADMIN, authenticated=False)
