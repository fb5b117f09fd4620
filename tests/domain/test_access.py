"""The role table: each role can do what its job needs and nothing else."""

from __future__ import annotations

import pytest

from domain.access import DEV_PRINCIPAL, Action, Role, allows, roles_allowed


@pytest.mark.parametrize(
    ("role", "allowed"),
    [
        (Role.AGENT, {Action.HOLD}),
        (Role.DASHBOARD, {Action.READ_STATE}),
        (Role.INVESTIGATOR, {Action.READ_STATE, Action.READ_HISTORY}),
        (Role.ADMIN, set(Action)),
    ],
)
def test_each_role_allows_exactly_its_actions(role: Role, allowed: set[Action]) -> None:
    assert {action for action in Action if allows(role, action)} == allowed


def test_only_admins_force_release_and_manage_tokens_and_agents_never_read_history() -> None:
    assert roles_allowed(Action.FORCE_RELEASE) == [Role.ADMIN]
    assert roles_allowed(Action.MANAGE_TOKENS) == [Role.ADMIN]
    assert Role.AGENT not in roles_allowed(Action.READ_HISTORY)


def test_the_dev_principal_is_unauthenticated() -> None:
    assert DEV_PRINCIPAL.authenticated is False
    assert allows(DEV_PRINCIPAL.role, Action.FORCE_RELEASE)
