"""The clients and their results, where they have always been imported from: ``AsyncClient`` (asyncio,
``lockledger/_async``, the source) and ``Client`` (threads, ``lockledger/_sync``, generated from it).
"""

from lockledger._async.client import AsyncClient
from lockledger._sync.client import Client
from lockledger.event import Event
from lockledger.records import ForceReleased, History, LeaseInfo, LockInfo, LockPage, Released, Reply
from lockledger.replay import (
    AgentEvent,
    AgentHistory,
    Change,
    Changes,
    ExportedEvent,
    ReplayLease,
    ReplayState,
)
from lockledger.wire import check_owner, check_resource

HistoryEvent = Event  # the log's one event record, by the name a resource's history had for it

__all__ = [
    "AgentEvent",
    "AgentHistory",
    "AsyncClient",
    "Change",
    "Changes",
    "Client",
    "Event",
    "ExportedEvent",
    "ForceReleased",
    "History",
    "HistoryEvent",
    "LeaseInfo",
    "LockInfo",
    "LockPage",
    "Released",
    "ReplayLease",
    "ReplayState",
    "Reply",
    "check_owner",
    "check_resource",
]
