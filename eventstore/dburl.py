"""Database URLs: what the user gives (``postgresql://...``) and what each driver wants.

A URL may name several servers, as libpq and asyncpg accept it (``postgresql://u:p@h1:5432,h2:5433/db
?target_session_attrs=read-write``: the first that answers and is the primary), which is how lockledger
reaches a Patroni cluster (``lockledger cluster up`` prints such a URL). asyncpg takes it as it is;
SQLAlchemy (alembic) parses one host per URL, so for it the hosts move into repeated ``host`` query
parameters, which its asyncpg dialect hands to asyncpg as a list.
"""

from __future__ import annotations

import os
from urllib.parse import quote

DATABASE_URL_ENV = "LOCKLEDGER_DATABASE_URL"


def database_url_from_env() -> str | None:
    return os.environ.get(DATABASE_URL_ENV) or None


def _hosts_as_query(rest: str) -> str:
    """``user@h1:p1,h2:p2/db?x=1`` → ``user@/db?host=h1:p1&host=h2:p2&x=1``; one host: unchanged."""
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    netloc, tail = rest[:cut], rest[cut:]
    userinfo, at, hosts = netloc.rpartition("@")
    if "," not in hosts:
        return rest
    path, _, query = tail.partition("?")
    # SQLAlchemy wants every port when there are several hosts; libpq's default is 5432.
    with_ports = [h if h.rpartition("]")[2].count(":") else f"{h}:5432" for h in hosts.split(",") if h]
    params = [f"host={quote(host, safe=':[]')}" for host in with_ports]
    if query:
        params.append(query)
    return f"{userinfo}{at}{path or '/'}?{'&'.join(params)}"


def sqlalchemy_url(url: str) -> str:
    """The same URL for SQLAlchemy's asyncpg dialect (alembic), several hosts as ``host`` parameters."""
    for prefix in ("postgresql+asyncpg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+asyncpg://" + _hosts_as_query(url[len(prefix) :])
    raise ValueError(f"not a PostgreSQL URL: {url.split('@')[-1]}")


def asyncpg_dsn(url: str) -> str:
    """The same URL for asyncpg itself, which does not accept a ``+driver`` suffix."""
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)


def multi_host(url: str) -> bool:
    """Whether ``url`` names several servers."""
    rest = url.partition("://")[2]
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    return "," in rest[:cut].rpartition("@")[2]


def single_host_urls(url: str) -> list[str]:
    """One URL per server a multi-host ``url`` names, in its order, each with the rest of ``url``; a
    single-host URL as it is."""
    scheme, sep, rest = url.partition("://")
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    netloc, tail = rest[:cut], rest[cut:]
    userinfo, at, hosts = netloc.rpartition("@")
    return [f"{scheme}{sep}{userinfo}{at}{host}{tail}" for host in hosts.split(",") if host]
