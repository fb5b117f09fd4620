"""The SDK's public surface without a server: what ``lockledger`` exports, durations in seconds converted
to the server's milliseconds only on the wire, and resources checked before any URL is built."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

import lockledger
from lockledger import AsyncClient, Client, LockLedgerError, Unavailable, ValidationError
from lockledger import client as client_module
from lockledger import errors as errors_module
from lockledger import lease as lease_module

LEASE = {
    "resource": "zone:A3",
    "owner": "agv-1",
    "fencing_token": 7,
    "expires_at": "2026-01-01T00:00:00.000000Z",
    "ttl_ms": 1500,
}
LOCK = {
    **LEASE,
    "status": "held",
    "acquired_at": "2026-01-01T00:00:00.000000Z",
    "updated_at": "2026-01-01T00:00:00.000000Z",
    "version": 3,
    "ended_by": None,
}


def _answer(request: httpx.Request) -> httpx.Response:
    """What the server would answer, as far as these tests look at it."""
    path = request.url.path
    if path == "/v1/locks":
        return httpx.Response(200, json={"items": [LOCK], "next_cursor": None})
    if path.endswith("/release"):
        return httpx.Response(200, json={**LEASE, "released": True})
    if path.endswith("/force-release"):
        return httpx.Response(200, json={"resource": LEASE["resource"], "released": False})
    if path.endswith("/history"):
        return httpx.Response(200, json={"resource": "zone:A3", "events": [], "next_after_version": None})
    if request.method == "GET":
        return httpx.Response(200, json=LOCK)
    return httpx.Response(201, json=LEASE)


class Recorder:
    """An in-memory server for both clients: records each request and answers like the real one."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return _answer(request)

    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(r.content) for r in self.requests if r.method == "POST"]


def _sync(recorder: Recorder) -> Client:
    return Client("http://locks.test", transport=httpx.MockTransport(recorder), agent_id="agv-1")


def _async(recorder: Recorder) -> AsyncClient:
    return AsyncClient("http://locks.test", transport=httpx.MockTransport(recorder), agent_id="agv-1")


# --- what the package exports --------------------------------------------------------------------------


def test_the_package_exports_clients_leases_errors_and_breaker_config() -> None:
    assert set(lockledger.__all__) == {
        "AsyncClient", "Client", "AsyncLease", "Lease",
        "AsyncReservation", "Reservation", "ReservationInfo",
        "LockLedgerError", "LockHeld", "NotHolder", "LeaseExpired", "LockLost", "ValidationError",
        "NotFound", "Unauthorized", "Forbidden", "Unavailable", "CircuitOpen",
        "BreakerConfig", "CircuitBreaker", "State", "__version__",
    }  # fmt: skip
    for name in lockledger.__all__:
        assert getattr(lockledger, name) is not None
    for name in client_module.__all__:  # the result dataclasses stay importable from lockledger.client
        assert getattr(client_module, name) is not None


def _server_codes() -> set[str]:
    """Every problem ``code`` the server sends (tests may import server code; the SDK never does)."""
    from api.problems import _HTTP_CODES
    from domain.errors import DomainError
    from service.errors import ServiceError

    def codes(base: type[Exception]) -> set[str]:
        found: set[str] = set()
        for cls in base.__subclasses__():
            found |= {str(cls.code)} | codes(cls)  # type: ignore[attr-defined]
        return found

    return codes(DomainError) | codes(ServiceError) | set(_HTTP_CODES.values()) | {"validation_error"}


def test_every_exported_error_is_one_the_server_sends_or_the_sdk_raises() -> None:
    exported = {getattr(errors_module, name) for name in errors_module.__all__} | {
        getattr(lockledger, name) for name in lockledger.__all__
    }
    errors = {cls for cls in exported if isinstance(cls, type) and issubclass(cls, LockLedgerError)}
    sdk_only = {"error", "lock_lost"}  # the base class; a lease the SDK can no longer vouch for
    assert {cls.code for cls in errors} - sdk_only <= _server_codes()
    assert not hasattr(errors_module, "IdempotencyKeyInProgress")  # the server never sends it


def _public_names() -> list[tuple[str, str]]:
    """(where, name) for every parameter of the SDK's public callables and every result field."""
    names: list[tuple[str, str]] = []
    classes: list[type] = []
    for module in (client_module, lease_module, errors_module):
        classes += [obj for n in module.__all__ if isinstance(obj := getattr(module, n), type)]
    for cls in classes:
        if cls.__module__ == "lockledger_breaker":  # its own module, with its own names
            continue
        if dataclasses.is_dataclass(cls):
            names += [(cls.__name__, f.name) for f in dataclasses.fields(cls)]
        for attr, member in vars(cls).items():
            if callable(member) and (not attr.startswith("_") or attr == "__init__"):
                names += [(f"{cls.__name__}.{attr}", p) for p in inspect.signature(member).parameters]
    return names


def test_durations_are_seconds_with_plain_names() -> None:
    names = _public_names()
    assert ("AsyncClient.acquire", "ttl") in names
    assert ("LeaseInfo", "ttl") in names
    assert ("Unavailable.__init__", "retry_after") in names
    unit_suffixed = [(where, n) for where, n in names if n.endswith(("_ms", "_s"))]
    assert unit_suffixed == []


# --- durations: seconds in the API, milliseconds on the wire -------------------------------------------


def test_seconds_become_the_servers_milliseconds_on_the_wire() -> None:
    recorder = Recorder()
    with _sync(recorder) as client:
        lease = client.acquire("zone:A3", "agv-1", ttl=1.5, wait=2.25)
        client.acquire("zone:A3", "agv-1")
        client.renew("zone:A3", "agv-1", 7, ttl=0.75)
        client.renew("zone:A3", "agv-1", 7)
        page = client.list_locks(expiring_within=90.0)
        lock = client.get_lock("zone:A3")
    assert recorder.bodies() == [
        {"owner": "agv-1", "ttl_ms": 1500, "wait_ms": 2250},
        {"owner": "agv-1"},  # no ttl: the server's default; no wait: answered at once
        {"owner": "agv-1", "fencing_token": 7, "ttl_ms": 750},
        {"owner": "agv-1", "fencing_token": 7},
    ]
    assert recorder.requests[4].url.params["expiring_within_ms"] == "90000"
    assert lease.ttl == 1.5
    assert page.items[0].ttl == 1.5
    assert lock.ttl == 1.5


async def test_the_async_client_converts_the_same_way() -> None:
    recorder = Recorder()
    async with _async(recorder) as client:
        lease = await client.acquire("zone:A3", "agv-1", ttl=30, wait=0.5)
        await client.renew("zone:A3", "agv-1", 7, ttl=2.0)
        every = [lock.ttl async for lock in client.iter_locks(expiring_within=1.5)]
    assert recorder.bodies() == [
        {"owner": "agv-1", "ttl_ms": 30_000, "wait_ms": 500},
        {"owner": "agv-1", "fencing_token": 7, "ttl_ms": 2000},
    ]
    assert recorder.requests[-1].url.params["expiring_within_ms"] == "1500"
    assert (lease.ttl, every) == (1.5, [1.5])


def test_a_lock_without_ttl_in_the_answer_has_none() -> None:
    info = client_module.LockInfo.from_json({**LOCK, "ttl_ms": None, "status": "free"})
    assert info.ttl is None


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_a_duration_that_is_no_number_of_seconds_is_refused_before_sending(bad: float) -> None:
    recorder = Recorder()
    with _sync(recorder) as client:
        calls: list[Callable[[], object]] = [
            lambda: client.acquire("zone:A3", "agv-1", ttl=bad),
            lambda: client.acquire("zone:A3", "agv-1", wait=bad),
            lambda: client.renew("zone:A3", "agv-1", 7, ttl=bad),
            lambda: client.list_locks(expiring_within=bad),
        ]
        for call in calls:
            with pytest.raises(ValidationError) as refused:
                call()
            assert refused.value.status == 0
    assert recorder.requests == []


def test_managed_leases_send_their_ttl_in_milliseconds() -> None:
    recorder = Recorder()
    with _sync(recorder) as client, client.lock("zone:A3", ttl=2.5) as lease:
        assert (lease.ttl, lease.fencing_token) == (2.5, 7)
    assert recorder.bodies()[0] == {"owner": "agv-1", "ttl_ms": 2500}
    assert recorder.bodies()[-1] == {"owner": "agv-1", "fencing_token": 7}
    assert recorder.requests[-1].url.path == "/v1/locks/zone:A3/release"


async def test_async_managed_leases_send_their_ttl_and_wait_in_milliseconds() -> None:
    recorder = Recorder()
    async with _async(recorder) as client, client.lock("zone:A3", ttl=4, wait=600):
        pass
    first = recorder.bodies()[0]
    assert first["ttl_ms"] == 4000
    assert 0 < first["wait_ms"] <= 600_000  # what is left of the wait when the request leaves


def test_retry_after_is_seconds() -> None:
    response = httpx.Response(
        503,
        json={"code": "unavailable", "status": 503, "detail": "later"},
        headers={"Retry-After": "3"},
        request=httpx.Request("GET", "http://locks.test/readyz"),
    )
    error = errors_module.error_from_response(response)
    assert isinstance(error, Unavailable)
    assert error.retry_after == 3.0


# --- resources are checked before they go into a URL ---------------------------------------------------

BAD_RESOURCES = [
    "", "a/b", "/", "zone/../admin", ".", "..", "...", "x" * 201, "bad resource!", "zöne", "a?b", "a#b",
    "a%2Fb", "a\nb", "zone:A3\n",
]  # fmt: skip
GOOD_RESOURCES = ["a", "x" * 200, ".a", "a.", "..a", "zone:A3", "pallet-42_b.c:d"]


def _sync_calls(client: Client, resource: str) -> list[Callable[[], object]]:
    return [
        lambda: client.acquire(resource, "agv-1"),
        lambda: client.renew(resource, "agv-1", 7),
        lambda: client.release(resource, "agv-1", 7),
        lambda: client.force_release(resource, "why"),
        lambda: client.get_lock(resource),
        lambda: client.history(resource),
        lambda: client.lock(resource),
    ]


def _async_calls(client: AsyncClient, resource: str) -> list[Callable[[], Awaitable[object]]]:
    async def lock() -> None:
        client.lock(resource)

    return [
        lambda: client.acquire(resource, "agv-1"),
        lambda: client.renew(resource, "agv-1", 7),
        lambda: client.release(resource, "agv-1", 7),
        lambda: client.force_release(resource, "why"),
        lambda: client.get_lock(resource),
        lambda: client.history(resource),
        lock,
    ]


@pytest.mark.parametrize("resource", BAD_RESOURCES)
def test_a_bad_resource_is_refused_before_any_request(resource: str) -> None:
    recorder = Recorder()
    with _sync(recorder) as client:
        for call in _sync_calls(client, resource):
            with pytest.raises(ValidationError) as refused:
                call()
            assert isinstance(refused.value, ValueError)
            assert refused.value.status == 0
            assert refused.value.code == "validation_error"
            assert "1-200 characters" in refused.value.detail
    assert recorder.requests == []


@pytest.mark.parametrize("resource", BAD_RESOURCES)
async def test_the_async_client_refuses_a_bad_resource_before_any_request(resource: str) -> None:
    recorder = Recorder()
    async with _async(recorder) as client:
        for call in _async_calls(client, resource):
            with pytest.raises(ValueError, match="invalid resource"):
                await call()
    assert recorder.requests == []


def test_a_resource_that_is_no_string_is_refused() -> None:
    with _sync(Recorder()) as client, pytest.raises(ValidationError):
        client.get_lock(42)  # type: ignore[arg-type]


@pytest.mark.parametrize("resource", GOOD_RESOURCES)
def test_a_good_resource_is_one_path_segment_as_is(resource: str) -> None:
    recorder = Recorder()
    with _sync(recorder) as client:
        for call in _sync_calls(client, resource)[:-1]:
            call()
    paths = [r.url.raw_path.decode() for r in recorder.requests]
    base = f"/v1/locks/{resource}"
    assert paths == [
        f"{base}/acquire", f"{base}/renew", f"{base}/release", f"{base}/force-release", base,
        f"{base}/history?after_version=0&limit=100",
    ]  # fmt: skip
