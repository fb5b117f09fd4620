"""Settings, from ``LOCKLEDGER_*`` environment variables (pydantic-settings), with safe defaults."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from domain.resource import TtlBounds


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LOCKLEDGER_", extra="ignore")

    database_url: str | None = Field(
        default=None, description="PostgreSQL URL; without it `lockledger serve` starts an embedded server."
    )
    database_role: str = Field(
        default="lockledger_service",
        description="Role the service switches to on connect (INSERT+SELECT on events); empty to stay as is.",
    )
    read_database_url: str | None = Field(
        default=None,
        description="Where the query and history endpoints read, e.g. a streaming replica; the main"
        " database when unset. Replicas lag: a lock just taken may not show there yet.",
    )
    read_database_role: str = Field(
        default="lockledger_readonly",
        description="Role the query pool switches to (SELECT on events and lock_state only).",
    )
    read_pool_max_size: int = 4
    pool_min_size: int = 2
    pool_max_size: int = 16
    pool_acquire_timeout_s: float = Field(default=2.0, description="Wait for a free connection, then 503.")
    statement_timeout_ms: int = Field(default=5_000, description="Per-statement bound on the server side.")
    command_timeout_s: float = Field(default=2.0, description="Client-side bound on one database round trip.")

    ttl_min_ms: int = 1_000
    ttl_max_ms: int = 3_600_000
    ttl_default_ms: int = 30_000
    coalesce: bool = Field(default=True, description="Batch concurrent commands' reads and commits.")
    order_in_flight: bool = Field(
        default=True,
        description="A command waits for this process's commits in flight on its lock before deciding.",
    )
    database_guard: bool = Field(
        default=True,
        description="Every round trip through the circuit breaker and stall watchdog (503 while the"
        " database does not answer).",
    )
    state_cache_size: int = Field(
        default=100_000,
        ge=0,
        description="Locks whose last state each process remembers, so that a renew or release of a lease"
        " it granted (or an acquire of a lock it saw free) appends without reading first; 0 reads first"
        " every time.",
    )
    max_wait_ms: int = Field(
        default=30_000,
        ge=0,
        description="The longest an acquire waits for a held lock (its `wait_ms`; longer is cut to this),"
        " kept under the idle timeouts of proxies in front.",
    )
    wait_poll_ms: int = Field(
        default=50,
        ge=1,
        description="While reservations wait, how often each process asks which awaited locks came free"
        " through other processes or lapsed (a release through the same process wakes at once; waiting"
        " acquires are queued in the database and woken by NOTIFY, never polled).",
    )
    conflict_retries: int = Field(
        default=16, description="Re-decisions after losing an expected-version race."
    )

    dev_mode: bool = Field(
        default=False,
        description="Authentication off: every caller is an anonymous admin naming the owner in the body."
        " For a laptop only; `lockledger serve --dev` says so loudly.",
    )
    auth_cache_s: float = Field(
        default=10.0,
        description="Tokens seen are remembered; every this many seconds each process asks the database"
        " which were revoked (so a revoked token works at most this long).",
    )

    idempotency_retention_s: int = Field(default=86_400, description="How long Idempotency-Keys are kept.")

    reaper_enabled: bool = Field(default=True, description="Run the reaper inside `serve`.")
    opentelemetry: bool = Field(
        default=False,
        description="FastAPI's native OpenTelemetry (request traces, HTTP metrics, error logs) to the"
        " providers this process configures. Off by default: even unconfigured it looks the providers up"
        " on every request, about 4 % of the server's CPU on the command path; /metrics is Prometheus.",
    )
    projectors_enabled: bool = Field(
        default=True, description="Keep the asynchronous projections (holding_periods) inside `serve`."
    )
    projector_poll_ms: int = Field(
        default=100, description="Pause between projector passes that found nothing new."
    )
    reaper_interval_ms: int = Field(
        default=200, description="Pause between reaper passes that found nothing."
    )
    reaper_batch_size: int = 1_000
    beacon_interval_ms: int = Field(
        default=1_000,
        ge=10,
        description="How often each instance writes the outage beacon (a gap in it is an outage).",
    )
    outage_after_ms: int = Field(
        default=3_000,
        ge=20,
        description="A beacon gap longer than this is an outage: live leases are extended by it, so none"
        " lapses while no instance could reach a writable primary. At least twice the beacon interval.",
    )
    idempotency_purge_batch: int = 5_000
    partition_interval: Literal["day", "month"] = Field(
        default="month",
        description="The time each new partition of the events table covers (UTC days or months); the"
        " reaper creates them ahead. Changing it applies from the end of the partitions already made.",
    )
    partitions_ahead: int = Field(
        default=3,
        ge=1,
        description="How many intervals past now the partitions cover; an event no partition covers"
        " goes to the default partition (docs/operations.md).",
    )
    retention_days: int | None = Field(
        default=None,
        ge=1,
        description="Archive each partition of the log whose range ended more than this many days ago to"
        " a file in `archive_dir`, then drop it from the database (docs/operations.md). Unset: every event"
        " stays in the database.",
    )
    archive_dir: str | None = Field(
        default=None, description="Where retention writes archive files (`lockledger archive --dir`)."
    )
    retention_interval_s: float = Field(
        default=3_600.0, gt=0, description="How often retention looks for partitions to archive."
    )

    max_body_bytes: int = Field(
        default=16_384,
        ge=1,
        description="Largest request body accepted (a 1000-character force-release reason, JSON-escaped,"
        " fits); larger is 413 `payload_too_large`.",
    )
    max_header_bytes: int = Field(
        default=8_192,
        ge=1,
        description="Largest request header section (names, values, 4 bytes of framing per line);"
        " larger is 431 `headers_too_large`.",
    )

    http_head_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="A request head (request line and headers) must arrive within this long after it"
        " began, a new connection's first within this long after it was accepted; otherwise 408"
        " `request_timeout` and the connection is closed.",
    )
    http_body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="A request body must arrive within this long after its head; otherwise 408"
        " `request_timeout` and the connection is closed.",
    )
    http_write_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="A client must take a response it is sent: once its connection's write buffer is"
        " full (above the high-water mark, 64 KiB), it must drain within this long, or the connection is"
        " aborted. This ends a change-feed reader that stopped reading.",
    )
    http_max_connections: int | None = Field(
        default=None,
        ge=1,
        description="Client connections one server process holds at most. Beyond it a new connection"
        " displaces one without a complete request, or is refused with 503 `unavailable` when every"
        " connection is being served. Unset: the open-file limit (`ulimit -n`) minus a reserve for the"
        " database pools and files; a larger value is lowered to that.",
    )

    @model_validator(mode="after")
    def _retention_has_a_directory(self) -> Settings:
        if self.retention_days is not None and not self.archive_dir:
            raise ValueError("LOCKLEDGER_RETENTION_DAYS needs LOCKLEDGER_ARCHIVE_DIR: where the archives go")
        return self

    @property
    def ttl_bounds(self) -> TtlBounds:
        return TtlBounds(min_ms=self.ttl_min_ms, max_ms=self.ttl_max_ms, default_ms=self.ttl_default_ms)
