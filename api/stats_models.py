"""The body of ``GET /v1/stats``: one server process's counters, for the dashboard's rate charts."""

from __future__ import annotations

from pydantic import BaseModel, Field

from api.models import Timestamp


class ServerProcess(BaseModel):
    id: str = Field(description="Random per process: a new id means a restart or another worker.")
    started_at: Timestamp


class Stats(BaseModel):
    at: Timestamp = Field(description="This process's clock when the counters were read.")
    process: ServerProcess
    commands: dict[str, dict[str, int]] = Field(
        description="Commands this process executed since it started, by command and outcome: granted,"
        " renewed, released, force_released, replayed, or a refusal's code (lock_held, not_holder,"
        " lease_expired, ...). A rate is the difference of two reads from the same process over their"
        " `at`.",
        examples=[{"acquire": {"granted": 120, "lock_held": 7}, "renew": {"renewed": 3400}}],
    )
    leases_expired: int = Field(description="Leases this process's reaper expired since it started.")
    leases_held: int = Field(description="Leases held now (deadline ahead), database-wide.")


class AgentFigures(BaseModel):
    owner: str
    holds: int = Field(description="Leases the agent acquired.")
    ended: int = Field(
        description="Of those, the leases whose end (release, expiry, force-release) is logged."
    )
    mean_hold_ms: int | None = Field(
        description="Mean time from acquire to end over the ended leases (a lapsed one ends at its deadline)."
    )
    lapses: int = Field(description="Leases that ended by expiring: the agent stopped renewing in time.")


class AgentStatsPage(BaseModel):
    items: list[AgentFigures] = Field(
        description="Per agent, the busiest first, from the agent_stats projection (it may trail the log by"
        " its lag on /metrics). Refused acquires are not logged, so conflicts are not counted here; the"
        " dashboard's conflicts/s comes from /v1/stats."
    )
