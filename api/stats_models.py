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
