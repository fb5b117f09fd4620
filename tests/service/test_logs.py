"""The server's logging (service/logs.py, service/redaction.py): secrets out, no frame locals, one
traceback per exception, rendering off the caller's thread with a bounded queue, one level for all."""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
from prometheus_client import REGISTRY
from typer.testing import CliRunner

from service import logs
from service.logs import configure_logging, stop_logging
from service.redaction import REDACTED, redact

TOKEN = "llt_" + "Zk3" * 14  # the shape of an API token (service/tokens.py)


@pytest.fixture
def output() -> Iterator[io.StringIO]:
    """A stream the configured logging writes to; the test process's logging restored afterwards."""
    stream = io.StringIO()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield stream
    stop_logging()
    structlog.reset_defaults()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def written(stream: io.StringIO) -> list[dict[str, Any]]:
    """What was logged, once the listener thread has written everything out."""
    stop_logging()
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_redaction_by_name_and_by_shape() -> None:
    scope = {
        "path": "/v1/locks/a/acquire",
        "headers": [(b"host", b"x"), (b"authorization", b"Bearer " + TOKEN.encode())],
    }
    found = redact(
        {
            "scope": scope,
            "cookie": "session=abc",
            "fencing_token": 42,
            "message": f"sent Authorization: Bearer {TOKEN} and {TOKEN} alone",
            "dsn": "postgresql://lockledger:hunter2@db:5432/ll",
            "kv": "host=db user=ll password=hunter2 dbname=ll",
            "header": "Cookie: session=abc",
        }
    )
    text = repr(found)
    for secret in (TOKEN, "hunter2", "session=abc"):
        assert secret not in text
    assert found["scope"]["headers"] == [(b"host", b"x"), (b"authorization", REDACTED)]
    assert found["fencing_token"] == 42  # a lease's number, not a secret
    assert found["dsn"] == f"postgresql://lockledger:{REDACTED}@db:5432/ll"
    assert found["scope"]["path"] == "/v1/locks/a/acquire"


def _fail_with_a_local() -> None:
    frame_local = "frame-local-value-5e1d"  # a local variable a locals-rendering traceback would show
    assert frame_local
    raise RuntimeError("a reason")


def test_an_exception_is_one_plain_traceback_without_locals_or_secrets(output: io.StringIO) -> None:
    configure_logging("info", stream=output)
    scope = {"headers": [(b"authorization", f"Bearer {TOKEN}".encode())]}
    try:
        _fail_with_a_local()
    except RuntimeError as error:
        structlog.get_logger("lockledger.api").exception("unhandled error", path="/x", scope=scope)
        # uvicorn logs the same exception again ("Exception in ASGI application"): no second traceback.
        logging.getLogger("uvicorn.error").error("Exception in ASGI application\n", exc_info=error)
    lines = written(output)
    assert len(lines) == 2
    first, second = lines
    assert first["event"] == "unhandled error"
    assert first["level"] == "error"
    assert "_fail_with_a_local" in first["exception"]
    assert first["exception"].startswith("Traceback (most recent call last):")
    assert "exception" not in second
    text = output.getvalue()
    assert text.count("Traceback") == 1
    assert "frame-local-value-5e1d" not in text
    assert TOKEN not in text


def test_standard_library_records_are_redacted_too(output: io.StringIO) -> None:
    configure_logging("info", stream=output)
    logging.getLogger("uvicorn.error").warning("headers: %s", [(b"authorization", f"Bearer {TOKEN}")])
    logging.getLogger("asyncpg").warning("connect to postgresql://ll:hunter2@db/ll failed")
    lines = written(output)
    assert [line["logger"] for line in lines] == ["uvicorn.error", "asyncpg"]
    assert TOKEN not in output.getvalue()
    assert "hunter2" not in output.getvalue()


def test_one_level_for_structlog_and_the_standard_library(output: io.StringIO) -> None:
    configure_logging("warning", stream=output)
    structlog.get_logger("lockledger.feed").info("structlog info")
    logging.getLogger("uvicorn.error").info("stdlib info")
    structlog.get_logger("lockledger.feed").warning("structlog warning")
    logging.getLogger("uvicorn.error").warning("stdlib warning")
    assert [line["event"] for line in written(output)] == ["structlog warning", "stdlib warning"]


class _BlockedStream(io.StringIO):
    """A stream whose writes wait until released: a log destination that stopped taking lines."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def write(self, text: str) -> int:
        self.release.wait()
        return super().write(text)


def test_a_full_queue_drops_and_counts_records_instead_of_blocking_the_caller(
    output: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    def dropped() -> float:
        return REGISTRY.get_sample_value("lockledger_log_records_dropped_total") or 0.0

    monkeypatch.setattr(logs, "QUEUE_SIZE", 2)
    stream = _BlockedStream()
    configure_logging("info", stream=stream)
    before = dropped()
    log = structlog.get_logger("lockledger.test")
    for n in range(10):
        log.warning("line", n=n)  # returns although nothing can be written
    # At most one record is with the blocked writer and two wait in the queue.
    assert dropped() - before >= 7
    stream.release.set()
    stop_logging()
    assert 0 < len(stream.getvalue().splitlines()) <= 3


def test_serve_log_level_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from api import cli

    levels: list[str | int] = []

    class Configured(Exception):
        pass

    def record(level: str | int = "info", **_: Any) -> None:
        levels.append(level)
        raise Configured

    monkeypatch.setattr(logs, "configure_logging", record)
    result = CliRunner().invoke(cli.app, ["serve"], env={"LOCKLEDGER_LOG_LEVEL": "debug"})
    assert isinstance(result.exception, Configured)
    assert levels == ["debug"]
