"""The bench's reading of the server's /metrics: deltas over the window per batch kind, and the loop
lag's p99 from histogram buckets, on what prometheus_client itself serves."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Histogram, start_http_server

from bench.server import free_port
from bench.server_metrics import bucket_quantile, inside, scrape


class _Server:
    """The three histograms under lockledger's names, in a registry of their own, served over HTTP."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.size = Histogram(
            "lockledger_db_batch_size", "", ["kind"], buckets=(1, 4, 16, 64), registry=self.registry
        )
        self.seconds = Histogram(
            "lockledger_db_batch_seconds", "", ["kind"], buckets=(0.001, 0.01, 0.1), registry=self.registry
        )
        self.lag = Histogram(
            "lockledger_event_loop_lag_seconds", "", buckets=(0.001, 0.01, 0.1), registry=self.registry
        )
        self.port = free_port()
        self.http, self.thread = start_http_server(self.port, addr="127.0.0.1", registry=self.registry)
        self.url = f"http://127.0.0.1:{self.port}/metrics"

    def batch(self, kind: str, commands: int, seconds: float) -> None:
        self.size.labels(kind).observe(commands)
        self.seconds.labels(kind).observe(seconds)


@pytest.fixture
def server() -> Iterator[_Server]:
    served = _Server()
    yield served
    served.http.shutdown()


def test_the_window_counts_only_what_happened_inside_it(server: _Server) -> None:
    server.batch("commit", 50, 0.5)  # before the window: must not count
    server.lag.observe(0.5)
    before = scrape(server.url)
    for commands, seconds in ((10, 0.004), (20, 0.006), (30, 0.008)):
        server.batch("commit", commands, seconds)
    for _ in range(98):
        server.lag.observe(0.0005)
    server.lag.observe(0.05)
    server.lag.observe(0.05)
    view = inside(before, scrape(server.url), window_s=2.0)

    assert view["commit"] == {"batches_per_s": 1.5, "commands_per_batch": 20.0, "batch_ms": 6.0}
    assert view["load"] is None  # no read went out in the window
    lag = view["loop_lag_ms"]
    assert lag["wakeups"] == 100
    assert lag["mean"] == pytest.approx((98 * 0.5 + 2 * 50) / 100, abs=0.01)
    # 98 of 100 under 1 ms, 2 in (10, 100] ms: the 99th falls halfway into that bucket.
    assert lag["p99"] == pytest.approx(55.0)


def test_bucket_quantile_interpolates_like_histogram_quantile() -> None:
    buckets = [(0.001, 50.0), (0.01, 90.0), (0.1, 100.0), (float("inf"), 100.0)]
    assert bucket_quantile(buckets, 0.5) == pytest.approx(0.001)
    assert bucket_quantile(buckets, 0.7) == pytest.approx(0.001 + 0.009 * 20 / 40)
    assert bucket_quantile(buckets, 0.95) == pytest.approx(0.01 + 0.09 * 5 / 10)
    beyond = [(0.001, 0.0), (0.01, 0.0), (float("inf"), 10.0)]
    assert bucket_quantile(beyond, 0.99) == 0.01  # in +Inf: the last finite bound, as PromQL answers
