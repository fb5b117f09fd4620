"""Multi-host URLs (a Patroni cluster's) reach SQLAlchemy, which alembic uses, as its asyncpg dialect
wants them; asyncpg itself takes them as they are."""

from __future__ import annotations

import pytest
from sqlalchemy.dialects.postgresql.asyncpg import dialect
from sqlalchemy.engine import make_url

from eventstore.dburl import asyncpg_dsn, multi_host, sqlalchemy_url

CLUSTER = "postgresql://postgres:pw@127.0.0.1:5001,127.0.0.1:5002/lockledger?target_session_attrs=read-write"


def _connect_args(url: str) -> dict[str, object]:
    _, kwargs = dialect().create_connect_args(make_url(sqlalchemy_url(url)))  # type: ignore[no-untyped-call]
    return dict(kwargs)


def test_several_hosts_become_host_parameters() -> None:
    assert sqlalchemy_url(CLUSTER) == (
        "postgresql+asyncpg://postgres:pw@/lockledger"
        "?host=127.0.0.1:5001&host=127.0.0.1:5002&target_session_attrs=read-write"
    )
    assert _connect_args(CLUSTER) == {
        "database": "lockledger",
        "user": "postgres",
        "password": "pw",
        "host": ["127.0.0.1", "127.0.0.1"],
        "port": [5001, 5002],
        "target_session_attrs": "read-write",
    }


def test_a_host_without_port_gets_postgresql_default() -> None:
    assert _connect_args("postgresql://u@h1,h2:6000/db")["port"] == [5432, 6000]


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:p@db.example:5433/lockledger",
        "postgresql://postgres:@/lockledger?host=/tmp/pgdata&port=5433",
        "postgres://u@localhost/lockledger",
    ],
)
def test_one_host_is_unchanged(url: str) -> None:
    assert sqlalchemy_url(url) == "postgresql+asyncpg://" + url.partition("://")[2]
    assert not multi_host(url)


def test_asyncpg_takes_the_url_as_given() -> None:
    assert asyncpg_dsn(CLUSTER) == CLUSTER
    assert multi_host(CLUSTER)
