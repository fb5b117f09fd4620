"""The bench's PostgreSQL: a fresh database on a given server, or an embedded server of its own.

Either way the lockledger schema is migrated into it and every target (the server, the raw table, the
``eventsourcing`` recorder) uses that one database on that one server.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import psutil

from eventstore.dburl import asyncpg_dsn
from migrations.upgrade import upgrade


@dataclass
class BenchDatabase:
    url: str
    postgres_pid: int | None  # the postmaster, when it runs on this machine and is visible
    info: dict[str, Any] = field(default_factory=dict)
    _embedded: Any = None
    _admin_url: str | None = None
    _name: str | None = None
    _scratch: Path | None = None  # the temporary directory made for an embedded cluster's pgdata
    _siblings: list[str] = field(default_factory=list)  # databases made beside this one (``sibling``)

    def sibling(self, suffix: str) -> str:
        """A further empty database on the same server, named after this one, gone when this one is: a
        bench that compares schema variants keeps each in a database of its own on one cluster."""
        name = f"{self._name}_{suffix}"
        asyncio.run(execute(self.url, f'CREATE DATABASE "{name}"'))
        self._siblings.append(name)
        return replace_database(self.url, name)

    async def settle(self) -> dict[str, Any]:
        """VACUUM (ANALYZE) and CHECKPOINT before a cell, so that no cell pays for the dead rows, stale
        statistics and pending checkpoint the cells before it left (the raw-sql baseline alone leaves an
        autovacuum of its lease table due; a checkpoint falls due about once a minute under this load).
        Each cell then starts from the same kind of database whatever ran before it, which is what
        pgbench's vacuum before a run is for. Returns what was done and how long it took."""
        started = time.perf_counter()
        done: list[str] = []
        for statement in ("VACUUM (ANALYZE)", "CHECKPOINT"):
            try:
                await execute(self.url, statement)
            except asyncpg.InsufficientPrivilegeError:
                continue  # an external server's user that may not checkpoint: the cells still run
            done.append(statement)
        return {"done": done, "seconds": round(time.perf_counter() - started, 3)}

    def close(self) -> None:
        if self._embedded is not None:
            self._embedded.stop()  # removes pgdata, not the directory made to hold it
        elif self._admin_url and self._name:
            for name in [*self._siblings, self._name]:
                with contextlib.suppress(Exception):
                    asyncio.run(execute(self._admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)


def replace_database(url: str, database: str) -> str:
    """The same server URL pointing at another database (handles ``?host=`` socket URLs)."""
    head, sep, query = url.partition("?")
    scheme_host, _, _ = head.rpartition("/")
    return f"{scheme_host}/{database}{sep}{query}"


async def connect(url: str, **options: Any) -> asyncpg.Connection:
    """A connection as the URL's role; ``options`` go to ``asyncpg.connect``."""
    return await asyncpg.connect(asyncpg_dsn(url), **options)


async def execute(url: str, *statements: str) -> None:
    """Run ``statements`` in order on one connection of their own, as the URL's role."""
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


# How many WAL segments (16 MB each) a fresh embedded cluster is given before the first cell: 1 GB, over a
# minute of the busiest cell's WAL (about 13 MB/s at W = 64), where a default cell writes ten seconds of it.
WAL_SEGMENTS_READY = 64


async def prepare_wal(url: str, segments: int = WAL_SEGMENTS_READY) -> dict[str, Any]:
    """Give a freshly made cluster the WAL segments a server that has been running already has.

    PostgreSQL makes a WAL segment the first time it needs one: the backend that crosses into it writes
    16 MB of zeros and fsyncs them (``wal_init_zero``) while every commit waits behind it, about 11 ms on
    this machine once every 1.2 s at W = 64 (``pg_stat_io``, ``object = 'wal'``, ``context = 'init'``).
    A server that has run at this rate recycles the segments its checkpoints free instead, and writes
    none. So the bench's throwaway cluster switches through ``segments`` segments once, keeps them all
    recycled (``min_wal_size``), and every cell's checkpoint (``settle``) hands the ones that cell used on
    to the next. An external server is left as its operator configured it."""
    started = time.perf_counter()
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        segment_bytes = await conn.fetchval(
            "SELECT setting::bigint FROM pg_settings WHERE name = $1", "wal_segment_size"
        )
        segment_mb = int(segment_bytes) // (1024 * 1024)
        await conn.execute(f"ALTER SYSTEM SET min_wal_size = '{segments * segment_mb}MB'")
        await conn.execute("SELECT pg_reload_conf()")
        for _ in range(segments):
            # pg_switch_wal() ends a segment only if something was written to it since the last switch.
            await conn.execute("SELECT pg_logical_emit_message(false, 'lockledger-bench', '')")
            await conn.execute("SELECT pg_switch_wal()")
        await conn.execute("CHECKPOINT")
    finally:
        await conn.close()
    return {"segments": segments, "seconds": round(time.perf_counter() - started, 2)}


# The server settings every run's environment record names (min_wal_size: whether its WAL was prepared).
RECORDED_SETTINGS = (
    "shared_buffers", "synchronous_commit", "fsync", "max_connections", "wal_level", "min_wal_size",
)  # fmt: skip


async def server_settings(conn: asyncpg.Connection) -> dict[str, str]:
    """The server's version (``postgresql``) and ``RECORDED_SETTINGS``, as ``SHOW`` prints them, in one
    statement (``current_setting`` formats as ``SHOW`` does: ``1GB``, not ``pg_settings``' ``1024``)."""
    rows = await conn.fetch(
        "SELECT name, current_setting(name) AS value FROM unnest($1::text[]) AS name",
        ["server_version", *RECORDED_SETTINGS],
    )
    values = {str(row["name"]): str(row["value"]) for row in rows}
    return {"postgresql": values.pop("server_version"), **values}


async def inspect_server(url: str) -> tuple[int | None, dict[str, Any]]:
    """The postmaster's pid (None when PostgreSQL runs elsewhere) and ``server_settings``."""
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        backend = await conn.fetchval("SELECT pg_backend_pid()")
        info: dict[str, Any] = await server_settings(conn)
        try:  # while this backend is alive: its parent is the postmaster
            postmaster = psutil.Process(backend).parent()
            pid = postmaster.pid if postmaster is not None else None
        except psutil.Error:
            pid = None  # PostgreSQL runs elsewhere: its CPU is not measured
    finally:
        await conn.close()
    return pid, info


def provision(database_url: str | None) -> BenchDatabase:
    """A migrated, empty database for this run; ``close()`` drops it (or stops the embedded server)."""
    name = f"lockledger_bench_{uuid.uuid4().hex[:8]}"
    embedded = None
    scratch = None
    try:
        if database_url:
            asyncio.run(execute(database_url, f'CREATE DATABASE "{name}"'))
            url = replace_database(database_url, name)
        else:
            from eventstore import embedded as embedded_pg

            scratch = Path(tempfile.mkdtemp(prefix="lockledger-bench-"))
            embedded = embedded_pg.start(scratch / "pgdata", delete_on_stop=True)
            url = embedded.ensure_database(name)
        upgrade(url)
        wal = asyncio.run(prepare_wal(url)) if embedded is not None else None
        pid, info = asyncio.run(inspect_server(url))
    except BaseException:
        # Whatever was made before the failure goes: the database, the cluster, the directory.
        BenchDatabase("", None, {}, embedded, None if embedded else database_url, name, scratch).close()
        raise
    info["database"] = "embedded" if embedded is not None else "external"
    if wal is not None:
        info["wal_segments_prepared"] = wal
    return BenchDatabase(url, pid, info, embedded, None if embedded else database_url, name, scratch)
