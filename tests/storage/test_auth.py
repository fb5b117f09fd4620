"""Authentication and roles over real HTTP: who may do what, and an agent can never end another's lease."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import httpx
import pytest

from domain.access import Action, Role, allows
from lockledger import AsyncClient, Forbidden, Unauthorized
from tests.servers import IssueToken, ServerProcess

pytestmark = pytest.mark.storage


@pytest.fixture
async def api(auth_server: ServerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=auth_server.base_url, timeout=30.0) as client:
        yield client


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def name(unique_prefix: str, who: str) -> str:
    return f"{unique_prefix}{who}"


async def admin(issue_token: IssueToken, unique_prefix: str) -> str:
    return await issue_token(name(unique_prefix, f"admin-{uuid.uuid4().hex[:6]}"), Role.ADMIN)


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer llt_" + "x" * 43},  # well-formed, never issued
        {"Authorization": "Bearer not-a-token"},
        {"Authorization": "Basic dXNlcjpwYXNz"},
        {"Authorization": "Bearer"},
    ],
    ids=["none", "unknown", "malformed", "basic", "empty"],
)
async def test_a_call_without_a_valid_token_is_401_problem_json(
    api: httpx.AsyncClient, resource: str, headers: dict[str, str]
) -> None:
    for method, path, body in [
        ("POST", f"/v1/locks/{resource}/acquire", {"ttl_ms": 5000}),
        ("GET", "/v1/locks", None),
        ("GET", f"/v1/locks/{resource}/history", None),
    ]:
        response = await api.request(method, path, json=body, headers=headers)
        assert response.status_code == 401, (path, response.text)
        assert response.headers["content-type"] == "application/problem+json"
        assert response.headers["www-authenticate"].startswith("Bearer")
        assert response.json()["code"] == "unauthorized"


@pytest.mark.parametrize("command", ["acquire", "renew", "release", "force-release"])
async def test_credentials_are_checked_before_the_request_is_validated(
    api: httpx.AsyncClient, issue_token: IssueToken, unique_prefix: str, command: str
) -> None:
    """An anonymous caller learns nothing about what a valid command looks like: 401 first, whatever the
    path, headers and body; the same request with a token is then 422."""
    agent = await issue_token(name(unique_prefix, "agent"), Role.AGENT)
    request = {
        "url": f"/v1/locks/{unique_prefix}..bad resource/{command}",
        "content": b"{not json",
        "headers": {"Content-Type": "application/json", "Idempotency-Key": "k" * 300},
    }
    assert (await api.post(**request)).status_code == 401  # type: ignore[arg-type]
    authenticated = {**request, "headers": {**request["headers"], **bearer(agent)}}  # type: ignore[dict-item]
    refused = await api.post(**authenticated)  # type: ignore[arg-type]
    # force-release needs an admin: 403 before validation too.
    assert refused.status_code == (403 if command == "force-release" else 422), refused.text


async def test_health_and_docs_need_no_token(api: httpx.AsyncClient) -> None:
    for path in ["/healthz", "/readyz", "/openapi.json"]:
        assert (await api.get(path)).status_code == 200, path
    schema = (await api.get("/openapi.json")).json()
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    acquire = schema["paths"]["/v1/locks/{resource}/acquire"]["post"]
    assert {"401", "403"} <= set(acquire["responses"])


ENDPOINTS: dict[
    str, tuple[Action, Callable[[httpx.AsyncClient, str, dict[str, str]], Awaitable[httpx.Response]]]
] = {
    "acquire": (
        Action.HOLD,
        lambda c, r, h: c.post(f"/v1/locks/{r}/acquire", json={"ttl_ms": 5000}, headers=h),
    ),
    "renew": (
        Action.HOLD,
        lambda c, r, h: c.post(f"/v1/locks/{r}/renew", json={"fencing_token": 1}, headers=h),
    ),
    "release": (
        Action.HOLD,
        lambda c, r, h: c.post(f"/v1/locks/{r}/release", json={"fencing_token": 1}, headers=h),
    ),
    "force-release": (
        Action.FORCE_RELEASE,
        lambda c, r, h: c.post(f"/v1/locks/{r}/force-release", json={"reason": "drill"}, headers=h),
    ),
    "list": (Action.READ_STATE, lambda c, r, h: c.get("/v1/locks", headers=h)),
    "get": (Action.READ_STATE, lambda c, r, h: c.get(f"/v1/locks/{r}", headers=h)),
    "history": (Action.READ_HISTORY, lambda c, r, h: c.get(f"/v1/locks/{r}/history", headers=h)),
    "shared-history": (
        Action.READ_HISTORY,
        lambda c, r, h: c.get(f"/v1/shared-locks/{r}/history", headers=h),
    ),
    "stats": (Action.READ_STATE, lambda c, r, h: c.get("/v1/stats", headers=h)),
    "agent-stats": (Action.READ_STATE, lambda c, r, h: c.get("/v1/stats/agents", headers=h)),
    # The fleet at an instant and the changes around it are past lock state (the dashboard's slider);
    # an agent's timeline and the export are the history.
    "replay-state": (
        Action.READ_STATE,
        lambda c, r, h: c.get("/v1/replay/state", params={"at": "2020-01-01T00:00:00Z"}, headers=h),
    ),
    "replay-changes": (
        Action.READ_STATE,
        lambda c, r, h: c.get(
            "/v1/replay/changes",
            params={"from": "2020-01-01T00:00:00Z", "to": "2020-01-01T00:01:00Z"},
            headers=h,
        ),
    ),
    "agent-history": (Action.READ_HISTORY, lambda c, r, h: c.get(f"/v1/agents/{r}/history", headers=h)),
    "export": (Action.READ_HISTORY, lambda c, r, h: c.get("/v1/events", params={"prefix": r}, headers=h)),
    "issue-token": (
        Action.MANAGE_TOKENS,
        lambda c, r, h: c.post("/v1/tokens", json={"name": r, "role": "agent"}, headers=h),
    ),
    "list-tokens": (Action.MANAGE_TOKENS, lambda c, r, h: c.get("/v1/tokens", headers=h)),
    "revoke-token": (Action.MANAGE_TOKENS, lambda c, r, h: c.delete(f"/v1/tokens/{r}", headers=h)),
}


@pytest.mark.parametrize("role", list(Role))
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
async def test_each_role_reaches_exactly_its_endpoints(
    api: httpx.AsyncClient,
    issue_token: IssueToken,
    unique_prefix: str,
    resource: str,
    role: Role,
    endpoint: str,
) -> None:
    action, call = ENDPOINTS[endpoint]
    token = await issue_token(name(unique_prefix, role.value), role)
    response = await call(api, resource, bearer(token))
    if allows(role, action):
        # Allowed: whatever the lock says (404 never locked, 409 not holder, ...) but never 401/403.
        assert response.status_code not in (401, 403), response.text
    else:
        assert response.status_code == 403, response.text
        assert response.headers["content-type"] == "application/problem+json"
        problem = response.json()
        assert problem["code"] == "forbidden"
        assert role.value in problem["detail"]


async def test_the_owner_is_the_principal(
    api: httpx.AsyncClient, issue_token: IssueToken, unique_prefix: str, resource: str
) -> None:
    agent = name(unique_prefix, "bot1")
    token = await issue_token(agent, Role.AGENT)
    acquired = await api.post(f"/v1/locks/{resource}/acquire", json={"ttl_ms": 5000}, headers=bearer(token))
    assert acquired.status_code == 201, acquired.text
    assert acquired.json()["owner"] == agent

    # Naming yourself is fine; naming anyone else is a 403, before the lock is even looked at.
    renewed = await api.post(
        f"/v1/locks/{resource}/renew", json={"owner": agent, "fencing_token": 1}, headers=bearer(token)
    )
    assert renewed.status_code == 200, renewed.text
    other = f"{resource}-other"
    impostor = await api.post(
        f"/v1/locks/{other}/acquire", json={"owner": "someone-else"}, headers=bearer(token)
    )
    assert impostor.status_code == 403
    assert impostor.json()["code"] == "forbidden"
    operator = await admin(issue_token, unique_prefix)
    assert (await api.get(f"/v1/locks/{other}", headers=bearer(operator))).status_code == 404


async def test_an_agent_cannot_renew_or_release_another_agents_lease(
    api: httpx.AsyncClient,
    issue_token: IssueToken,
    admin_pool: asyncpg.Pool,
    unique_prefix: str,
    resource: str,
) -> None:
    alice = await issue_token(name(unique_prefix, "alice"), Role.AGENT)
    mallory = await issue_token(name(unique_prefix, "mallory"), Role.AGENT)
    lease = (
        await api.post(f"/v1/locks/{resource}/acquire", json={"ttl_ms": 10_000}, headers=bearer(alice))
    ).json()
    token = lease["fencing_token"]

    for command in ["renew", "release"]:
        # Mallory knows the resource and the fencing token (the lock_held problem even tells her): not enough.
        response = await api.post(
            f"/v1/locks/{resource}/{command}", json={"fencing_token": token}, headers=bearer(mallory)
        )
        assert response.status_code == 403, response.text
        assert response.json()["code"] == "forbidden"
        assert name(unique_prefix, "alice") in response.json()["detail"]
    stolen = await api.post(f"/v1/locks/{resource}/acquire", json={"ttl_ms": 1000}, headers=bearer(mallory))
    assert stolen.status_code == 409
    assert stolen.json()["code"] == "lock_held"

    async with admin_pool.acquire() as conn:
        types = await conn.fetch("SELECT event_type FROM events WHERE stream_id = $1", resource)
    assert [r["event_type"] for r in types] == ["LOCK_ACQUIRED"]
    released = await api.post(
        f"/v1/locks/{resource}/release", json={"fencing_token": token}, headers=bearer(alice)
    )
    assert released.status_code == 200
    assert released.json()["released"] is True


async def test_idempotency_keys_are_scoped_to_the_principal(
    api: httpx.AsyncClient, issue_token: IssueToken, unique_prefix: str, resource: str
) -> None:
    """Two agents that happen to use the same key get their own outcomes, never each other's."""
    first = await issue_token(name(unique_prefix, "one"), Role.AGENT)
    second = await issue_token(name(unique_prefix, "two"), Role.AGENT)
    key = {"Idempotency-Key": f"{resource}-shared"}
    a = await api.post(f"/v1/locks/{resource}-a/acquire", json={}, headers={**bearer(first), **key})
    b = await api.post(f"/v1/locks/{resource}-b/acquire", json={}, headers={**bearer(second), **key})
    assert (a.status_code, b.status_code) == (201, 201), (a.text, b.text)
    assert "Idempotent-Replayed" not in b.headers
    assert b.json()["owner"] == name(unique_prefix, "two")
    again = await api.post(f"/v1/locks/{resource}-a/acquire", json={}, headers={**bearer(first), **key})
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == a.content


async def test_a_revoked_token_stops_working_within_the_cache_time(
    api: httpx.AsyncClient, issue_token: IssueToken, admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    dashboard = name(unique_prefix, "wallboard")
    token = await issue_token(dashboard, Role.DASHBOARD)
    assert (await api.get("/v1/locks", headers=bearer(token))).status_code == 200
    async with admin_pool.acquire() as conn:
        from service import tokens

        assert await tokens.revoke(conn, dashboard) == 1
    await asyncio.sleep(0.7)  # the test server caches lookups for 0.5 s
    refused = await api.get("/v1/locks", headers=bearer(token))
    assert refused.status_code == 401
    assert refused.json()["code"] == "unauthorized"


async def test_only_the_hash_of_a_token_is_stored(
    issue_token: IssueToken, admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    token = await issue_token(name(unique_prefix, "hashed"), Role.AGENT)
    async with admin_pool.acquire() as conn:
        row = await conn.fetchrow("SELECT * FROM api_tokens WHERE name = $1", name(unique_prefix, "hashed"))
        leaked = await conn.fetchval(
            "SELECT count(*) FROM api_tokens WHERE position($1::bytea IN token_hash) > 0", token.encode()
        )
    assert row is not None
    assert bytes(row["token_hash"]) == hashlib.sha256(token.encode()).digest()
    assert token not in str(dict(row))
    assert leaked == 0


async def test_the_sdk_holds_leases_as_its_tokens_principal(
    auth_server: ServerProcess, issue_token: IssueToken, unique_prefix: str, resource: str
) -> None:
    agent = name(unique_prefix, "agv-7")
    token = await issue_token(agent, Role.AGENT)
    async with (
        AsyncClient(auth_server.base_url, token=token) as client,
        client.lock(resource, ttl=5) as lease,
    ):
        assert lease.owner == agent
        assert lease.fencing_token == 1
    async with AsyncClient(
        auth_server.base_url, token=await admin(issue_token, unique_prefix)
    ) as admin_client:
        info = await admin_client.get_lock(resource)
    assert info.owner == agent
    assert info.status == "free"


async def test_the_sdk_raises_typed_auth_errors_without_retrying(
    auth_server: ServerProcess, issue_token: IssueToken, unique_prefix: str, resource: str
) -> None:
    alice = await issue_token(name(unique_prefix, "alice"), Role.AGENT)
    mallory = await issue_token(name(unique_prefix, "mallory"), Role.AGENT)
    async with AsyncClient(auth_server.base_url, token=alice) as client:
        lease = await client.acquire(resource, ttl=10)
    async with AsyncClient(auth_server.base_url, token=mallory) as client:
        with pytest.raises(Forbidden) as forbidden:
            await client.release(resource, None, lease.fencing_token)
        assert forbidden.value.status == 403
        with pytest.raises(Forbidden):
            await client.force_release(resource, "not an admin")
        metrics = client.breaker.metrics
        assert (metrics.calls, metrics.failures) == (2, 0)  # one attempt each; a 403 means a healthy server
    async with AsyncClient(auth_server.base_url, token="llt_" + "0" * 43) as client:
        with pytest.raises(Unauthorized):
            await client.acquire(resource)


async def test_a_dev_mode_server_needs_no_token_but_an_owner(http: httpx.AsyncClient, resource: str) -> None:
    missing = await http.post(f"/v1/locks/{resource}/acquire", json={"ttl_ms": 5000})
    assert missing.status_code == 422
    assert missing.json()["errors"][0]["loc"] == ["body", "owner"]
    acquired = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "bot1", "ttl_ms": 5000})
    assert acquired.status_code == 201
    # Without authentication anyone may claim any owner id, so another owner is "not the holder", not 403.
    other = await http.post(f"/v1/locks/{resource}/release", json={"owner": "bot2", "fencing_token": 1})
    assert other.status_code == 409
    assert other.json()["code"] == "not_holder"


def _cli(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "api.cli", "tokens", *args, "--database-url", database_url],
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_the_tokens_cli_creates_lists_and_revokes(
    api: httpx.AsyncClient, database_url: str, unique_prefix: str
) -> None:
    agent = name(unique_prefix, "cli-bot")
    created = await asyncio.to_thread(_cli, database_url, "create", "--name", agent, "--role", "agent")
    assert created.returncode == 0, created.stderr
    token = created.stdout.strip()
    assert token.startswith("llt_")
    assert "not shown again" in created.stderr
    acquired = await api.post(f"/v1/locks/{unique_prefix}cli/acquire", json={}, headers=bearer(token))
    assert acquired.json()["owner"] == agent

    listed = await asyncio.to_thread(_cli, database_url, "list")
    assert agent in listed.stdout
    assert token not in listed.stdout

    clash = await asyncio.to_thread(_cli, database_url, "create", "--name", agent, "--role", "admin")
    assert clash.returncode == 2
    assert "already has live tokens with role agent" in clash.stderr
    bad_role = await asyncio.to_thread(_cli, database_url, "create", "--name", agent, "--role", "root")
    assert bad_role.returncode == 2
    bad_name = await asyncio.to_thread(_cli, database_url, "create", "--name", "no spaces", "--role", "agent")
    assert bad_name.returncode == 2

    revoked = await asyncio.to_thread(_cli, database_url, "revoke", "--name", agent)
    assert revoked.returncode == 0, revoked.stderr
    assert "revoked 1 token" in revoked.stderr
    again = await asyncio.to_thread(_cli, database_url, "revoke", "--name", agent)
    assert again.returncode == 1


async def test_an_admin_manages_tokens_over_http(
    api: httpx.AsyncClient, issue_token: IssueToken, unique_prefix: str, resource: str
) -> None:
    operator = bearer(await admin(issue_token, unique_prefix))
    agent = name(unique_prefix, "minted")
    issued = await api.post("/v1/tokens", json={"name": agent, "role": "agent"}, headers=operator)
    assert issued.status_code == 201, issued.text
    token = issued.json()["token"]
    assert issued.json()["role"] == "agent"
    acquired = await api.post(f"/v1/locks/{resource}/acquire", json={}, headers=bearer(token))
    assert acquired.json()["owner"] == agent

    listed = (await api.get("/v1/tokens", headers=operator)).json()["items"]
    assert [t["role"] for t in listed if t["name"] == agent] == ["agent"]
    assert token not in str(listed)

    clash = await api.post("/v1/tokens", json={"name": agent, "role": "admin"}, headers=operator)
    assert clash.status_code == 409
    assert clash.json()["code"] == "conflict"
    for bad in [{"name": agent, "role": "root"}, {"name": "has space", "role": "agent"}, {"name": agent}]:
        refused = await api.post("/v1/tokens", json=bad, headers=operator)
        assert refused.status_code == 422, bad
        assert refused.json()["code"] == "validation_error"

    revoked = await api.delete(f"/v1/tokens/{agent}", headers=operator)
    assert revoked.json() == {"name": agent, "revoked": 1}
    # This server process forgets its cached lookups at once; no cache wait needed.
    refused_now = await api.post(f"/v1/locks/{resource}-2/acquire", json={}, headers=bearer(token))
    assert refused_now.status_code == 401
    assert (await api.delete(f"/v1/tokens/{agent}", headers=operator)).status_code == 404
    everything = (await api.get("/v1/tokens?include_revoked=true", headers=operator)).json()["items"]
    assert [t["revoked_at"] is not None for t in everything if t["name"] == agent] == [True]


async def test_a_revoked_agents_name_cannot_come_back_with_another_role(
    api: httpx.AsyncClient, issue_token: IssueToken, unique_prefix: str, resource: str
) -> None:
    """An admin token under a revoked agent's name would hold that agent's live leases: refused."""
    operator = bearer(await admin(issue_token, unique_prefix))
    agent = name(unique_prefix, "retired")
    issued = await api.post("/v1/tokens", json={"name": agent, "role": "agent"}, headers=operator)
    lease = (
        await api.post(f"/v1/locks/{resource}/acquire", json={}, headers=bearer(issued.json()["token"]))
    ).json()
    assert (await api.delete(f"/v1/tokens/{agent}", headers=operator)).status_code == 200

    clash = await api.post("/v1/tokens", json={"name": agent, "role": "admin"}, headers=operator)
    assert clash.status_code == 409
    problem = clash.json()
    assert problem["code"] == "conflict"
    assert problem["detail"].startswith(f"{agent} had tokens (all revoked now) with role agent")
    assert "choose a new name" in problem["detail"]
    everything = (await api.get("/v1/tokens?include_revoked=true", headers=operator)).json()["items"]
    assert [t["role"] for t in everything if t["name"] == agent] == ["agent"]
    # The lease is still the retired agent's alone; a new agent token under the name is a rotation.
    assert (await api.get(f"/v1/locks/{resource}", headers=operator)).json()["owner"] == agent
    rotated = await api.post("/v1/tokens", json={"name": agent, "role": "agent"}, headers=operator)
    assert rotated.status_code == 201
    renew = {"fencing_token": lease["fencing_token"]}
    renewed = await api.post(
        f"/v1/locks/{resource}/renew", json=renew, headers=bearer(rotated.json()["token"])
    )
    assert renewed.status_code == 200, renewed.text
