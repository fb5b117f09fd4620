"""lockledger's benchmark: one load, several lock services, one PostgreSQL.

W simulated agents (asyncio tasks) repeatedly pick a resource out of R, acquire it, optionally renew it,
and release it, against each target in turn: lockledger's HTTP API, the same app stack's no-op twin (the
framework ceiling), a raw asyncpg lease table, the ``eventsourcing`` library and Redis. Every cell (target,
resource mode, W) reports throughput, latency percentiles per command, the CPU of each side and, in the hot
mode, any safety violation found in the grants. ``python -m bench --help`` lists the options.
"""
