"""Assertions shared by the tests: a command's grant, an RFC 9457 problem."""

from __future__ import annotations

from typing import Any

import httpx

from service.outcomes import CommandResult, Granted

PROBLEM_JSON = "application/problem+json"


def granted(result: CommandResult) -> Granted:
    """The lease a command's result granted (fails the test if it granted none)."""
    assert isinstance(result.outcome, Granted), result
    return result.outcome


def assert_problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """An RFC 9457 problem with the lockledger fields, and nothing that looks like a server error."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM_JSON
    body: dict[str, Any] = response.json()
    assert body["status"] == status
    assert body["code"] == code
    assert body["type"] == f"urn:lockledger:problem:{code}"
    assert isinstance(body["title"], str)
    assert body["title"]
    assert isinstance(body["detail"], str)
    assert body["detail"]
    return body
