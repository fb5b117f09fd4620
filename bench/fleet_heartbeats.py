"""The heartbeats scenario: A agents each take one lease, renew it every interval for a while, release.

Agent i's first renew comes at ``interval * (i + U(0, 1)) / A`` after the renewing starts, so the
renews arrive evenly (about A / interval per second). Every renew must answer 200; a 409 or 410 is a
lost lease, told apart by whether the renew left before the lease's deadline (the service answered too
late) or after it (the load generator fell behind). Afterwards the log must hold no LOCK_EXPIRED on any
of the agents' streams.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from array import array
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from datetime import datetime
from typing import Any

from bench.auth import agent_names
from bench.collector import quiet_gc
from bench.fleet_config import HeartbeatParams
from bench.fleet_log import clock_offset_s, connect_owner, events_by_type, expiries_before_deadline
from bench.fleet_measure import RunContext
from bench.fleet_requests import Agents, bounded, mint_tokens, status_counts
from bench.stats import latency_ms


async def run_heartbeats(ctx: RunContext, params: HeartbeatParams) -> dict[str, Any]:
    """A agents acquire, renew every ``interval_s`` for ``duration_s``, release; count lost leases."""
    prefix = f"fleet:hb:{ctx.run_id}:"
    n = params.agents
    tokens: list[int | None] = [None] * n
    deadlines: array[float] = array("d", bytes(8 * n))  # each lease's deadline, this machine's wall clock
    acquire_latency: array[float] = array("d")
    acquire_status: Counter[int] = Counter()
    loop = asyncio.get_running_loop()
    conn = await connect_owner(ctx.database_url)
    try:
        offset_s = await clock_offset_s(conn)
    finally:
        await conn.close()

    def deadline_of(body: bytes) -> float:
        return datetime.fromisoformat(json.loads(body)["expires_at"]).timestamp() - offset_s

    auth, minting = await mint_tokens(ctx.database_url, agent_names(f"fleet-{ctx.run_id}-hb-", n))
    async with Agents(ctx.host, ctx.port, auth, connections=params.concurrency) as http:
        ctx.console.print(
            f"[bold]heartbeats[/bold]: {n} agents (API tokens minted in {minting['seconds']:.2f} s) "
            f"acquire (ttl {params.ttl_ms} ms)"
        )
        acquire_begin = ctx.resources.mark()
        started = loop.time()

        def acquire_job(i: int) -> Callable[[], Awaitable[None]]:
            async def job() -> None:
                status, body, seconds = await http.post_with_retries(
                    i, f"/v1/locks/{prefix}{i}/acquire", {"ttl_ms": params.ttl_ms}
                )
                acquire_status[status] += 1
                acquire_latency.append(seconds)
                if status == 201:
                    tokens[i] = int(json.loads(body)["fencing_token"])
                    deadlines[i] = deadline_of(body)

            return job

        await bounded(params.concurrency, (acquire_job(i) for i in range(n)))
        acquire_s = loop.time() - started
        acquire_end = ctx.resources.mark()
        held = sum(token is not None for token in tokens)
        if acquire_s + params.interval_s > params.ttl_ms / 1000 * 0.9:
            ctx.console.print(
                f"[yellow]acquiring took {acquire_s:.1f} s: the first renews may come after a lease's "
                "deadline (that would be the load generator's fault, not the service's)[/yellow]"
            )

        target_rate = n / params.interval_s
        ctx.console.print(
            f"  {held} held in {acquire_s:.1f} s; renewing every {params.interval_s:g} s for "
            f"{params.duration_s:g} s (~{target_rate:,.0f} renews/s)"
        )
        renew_latency: array[float] = array("d")
        renew_ok_latency: array[float] = array("d")
        send_lag: array[float] = array("d")
        renew_status: Counter[int] = Counter()
        late_sends = 0  # renews the load generator sent after the lease's deadline (it fell behind)
        # 409/410 answers: agent, status, how long before the deadline the renew was sent, latency, body
        lost: list[dict[str, Any]] = []
        start = loop.time() + 0.5
        end = start + params.duration_s

        async def agent(i: int) -> None:
            nonlocal late_sends
            token = tokens[i]
            if token is None:
                return
            first = start + params.interval_s * (i + random.random()) / n
            k = 0
            while (when := first + k * params.interval_s) < end:
                k += 1
                delay = when - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                send_lag.append(loop.time() - when)
                sent = time.time()
                late_sends += sent >= deadlines[i]
                status, body, seconds = await http.post(
                    i, f"/v1/locks/{prefix}{i}/renew", {"fencing_token": token}
                )
                renew_status[status] += 1
                renew_latency.append(seconds)
                if status == 200:
                    renew_ok_latency.append(seconds)
                    deadlines[i] = deadline_of(body)
                elif status in (409, 410):
                    lost.append(
                        {
                            "agent": i,
                            "status": status,
                            "sent_before_deadline_s": round(deadlines[i] - sent, 3),
                            "latency_s": round(seconds, 3),
                            "body": body.decode(errors="replace")[:300],
                        }
                    )
                    tokens[i] = None
                    return

        renew_begin = ctx.resources.mark()
        agents = [asyncio.ensure_future(agent(i)) for i in range(n)]
        with quiet_gc():
            await asyncio.gather(*agents)
        renew_s = loop.time() - start
        renew_end = ctx.resources.mark()

        ctx.console.print("  releasing")
        release_status: Counter[int] = Counter()
        release_latency: array[float] = array("d")

        def release_job(i: int) -> Callable[[], Awaitable[None]]:
            async def job() -> None:
                token = tokens[i]
                if token is None:
                    return
                status, _, seconds = await http.post_with_retries(
                    i, f"/v1/locks/{prefix}{i}/release", {"fencing_token": token}
                )
                release_status[status] += 1
                release_latency.append(seconds)

            return job

        started = loop.time()
        await bounded(params.concurrency, (release_job(i) for i in range(n)))
        release_s = loop.time() - started

    conn = await connect_owner(ctx.database_url)
    try:
        events = await events_by_type(conn, prefix)
        premature = await expiries_before_deadline(conn, prefix)
    finally:
        await conn.close()

    renews_ok = renew_status.get(200, 0)
    spurious = events.get("LOCK_EXPIRED", 0)
    renew_errors = sum(c for s, c in renew_status.items() if s not in (200, 409, 410))
    lag = latency_ms(send_lag)
    checks = {
        "all_acquired": held == n,
        "every_renew_200": renews_ok == sum(renew_status.values()) and renews_ok > 0,
        "no_lost_lease": not lost,
        "no_spurious_expiry": spurious == 0,
        "no_expiry_before_deadline": premature == 0,
        "log_matches_answers": events.get("LOCK_RENEWED", 0) == renews_ok,
    }
    return {
        "kind": "heartbeats",
        "run_id": ctx.run_id,
        "params": asdict(params),
        "prefix": prefix,
        "tokens": minting,
        "acquire": {
            "held": held,
            "seconds": round(acquire_s, 2),
            "per_s": round(n / acquire_s, 1),
            "statuses": status_counts(acquire_status),
            "latency": latency_ms(acquire_latency),
            "resources": ctx.resources.between(acquire_begin, acquire_end),
        },
        "renew": {
            "target_per_s": round(target_rate, 1),
            "achieved_per_s": round(renews_ok / params.duration_s, 1),
            "ok": renews_ok,
            "statuses": status_counts(renew_status),
            "errors": renew_errors,
            "lost_leases": len(lost),
            # A lost lease whose renew was sent before the deadline: the service answered too late.
            # One sent after it: the load generator (or the machine) fell behind.
            "lost_sent_before_deadline": sum(1 for x in lost if x["sent_before_deadline_s"] > 0),
            "renews_sent_after_deadline": late_sends,
            "lost_examples": lost[:5],
            "latency_ok": latency_ms(renew_ok_latency),
            "latency_all": latency_ms(renew_latency),
            "client_loop_lag": ctx.loop_lag.between(renew_begin, renew_end),
            "send_lag_p99_ms": lag["p99_ms"],
            "send_lag_max_ms": lag["max_ms"],
            "seconds": round(renew_s, 2),
            "resources": ctx.resources.between(renew_begin, renew_end),
        },
        "release": {
            "seconds": round(release_s, 2),
            "statuses": status_counts(release_status),
            "latency": latency_ms(release_latency),
        },
        "events": events,
        "spurious_expiries": spurious,
        "expiries_before_deadline": premature,
        "checks": checks,
        "passed": all(checks.values()),
    }
