"""Hand-off through the SDK against the real server, both twins (docs/decisions/0047-lease-hand-off.md):
a managed lease handed on stops its heartbeats and releases nothing; the receiver's managed lease begins
by accepting, learns the token once, and renews and releases as any lease."""

from __future__ import annotations

import asyncio

import pytest

from lockledger import AsyncClient, Client, LockLost, NotHolder
from tests.servers import ServerProcess

pytestmark = pytest.mark.storage


async def test_a_managed_lease_is_handed_on_and_accepted(server: ServerProcess, unique_prefix: str) -> None:
    resource = f"{unique_prefix}pallet"
    giver, receiver = f"{unique_prefix}agv-1", f"{unique_prefix}agv-2"
    lost: list[LockLost] = []
    async with (
        AsyncClient(server.base_url, agent_id=giver) as ours,
        AsyncClient(server.base_url, agent_id=receiver) as theirs,
    ):
        async with ours.lock(resource, ttl=3, on_lost=lost.append) as lease:
            handed = await lease.hand_off(receiver, accept_within=10)
            assert lease.lost.is_set()  # over for the giver
            assert lease.handed_off == handed
            with pytest.raises(LockLost):
                lease.check()
        assert not lost  # a hand-off is no loss: on_lost is not called
        assert (handed.owner, handed.from_owner, handed.from_token) == (receiver, giver, lease.fencing_token)
        assert handed.fencing_token > lease.fencing_token
        assert handed.accept_within == 10

        info = await theirs.get_lock(resource)  # the giver's exit released nothing
        assert (info.status, info.owner, info.handed_off_by) == ("held", receiver, giver)

        async with theirs.accept_lock(resource, ttl=3) as taken:
            assert taken.fencing_token == handed.fencing_token
            for _ in range(600):  # renewed in the background, with the token it accepted
                if taken.renewals:
                    break
                await asyncio.sleep(0.05)
            assert taken.renewals
            taken.check()
        assert (await theirs.get_lock(resource)).status == "free"
        with pytest.raises(NotHolder):  # nothing awaits: the hand-off was taken up once
            await theirs.accept(resource, receiver)


def test_the_blocking_twin_hands_off_accepts_and_declines(server: ServerProcess, unique_prefix: str) -> None:
    resource = f"{unique_prefix}zone"
    giver, receiver = f"{unique_prefix}agv-1", f"{unique_prefix}agv-2"
    with (
        Client(server.base_url, agent_id=giver) as ours,
        Client(server.base_url, agent_id=receiver) as theirs,
    ):
        with ours.lock(resource, ttl=5) as lease:
            handed = lease.hand_off(receiver)
        assert handed.owner == receiver
        with theirs.accept_lock(resource, ttl=5) as taken:
            assert taken.fencing_token == handed.fencing_token
            again = taken.hand_off(giver, accept_within=5)
        assert ours.decline(resource, giver).fencing_token == again.fencing_token
        assert ours.get_lock(resource).status == "free"
        events = [e.type for e in ours.history(resource).events]
        assert events == [
            "LOCK_ACQUIRED",
            "LOCK_HANDED_OFF",
            "LOCK_RENEWED",
            "LOCK_HANDED_OFF",
            "LOCK_RELEASED",
        ]
