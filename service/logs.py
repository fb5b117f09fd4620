"""The server's logging, configured once at start: structlog over the standard library, rendered off the
event loop, secrets redacted, never a frame's local variables.

Unconfigured, structlog renders an exception as a Rich traceback with every frame's local variables (an
ASGI scope, and in it the client's ``Authorization`` header), synchronously on the event loop: thousands
of lines per error, each stalling every request in the process (docs/decisions/0035).

- **One path for every record.** structlog loggers hand their event dict to the standard library
  (``ProcessorFormatter.wrap_for_formatter``), so structlog's records and the standard library's
  (uvicorn's, asyncio's) meet in one handler and are rendered by one ``ProcessorFormatter``.
- **Off the loop.** That handler is a ``QueueHandler``: the calling thread only puts the record on a
  bounded queue; a ``QueueListener`` thread renders and writes it. When the queue is full the record is
  dropped, not waited for, and counted in ``lockledger_log_records_dropped_total``.
- **Rendering.** Exceptions become plain text (``format_exc_info``: the standard library's traceback,
  which shows no locals), then ``service.redaction.redact_secrets`` runs over the whole event, then the
  renderer: JSON lines when the output is not a terminal, structlog's console renderer (plain
  tracebacks) when it is.
- **One traceback per exception.** uvicorn logs "Exception in ASGI application" with the traceback of an
  exception the app's 500 handler has logged already; a record whose exception was logged with its
  traceback before keeps its line and loses the second traceback.
- **Level.** ``configure_logging(level)`` applies one level to structlog and to the standard library.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import logging
import logging.handlers
import queue
import sys
from typing import Any, Final, TextIO

import structlog
from prometheus_client import Counter
from structlog.typing import EventDict, Processor, WrappedLogger

from service.redaction import redact_secrets

QUEUE_SIZE: Final = 10_000  # records waiting to be rendered; more are dropped
_LOGGED_MARK: Final = "_lockledger_traceback_logged"

DROPPED = Counter(
    "lockledger_log_records_dropped_total",
    "Log records dropped because the queue to the thread that writes them was full",
)


class _Listener(logging.handlers.QueueListener):
    """The thread that renders and writes records."""

    def enqueue_sentinel(self) -> None:
        assert isinstance(self.queue, queue.Queue)
        self.queue.put(None)  # the listener's sentinel; waits for room where put_nowait would fail


_listener: _Listener | None = None


def capture_exc_info(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
    """structlog processor, on the calling thread: ``exc_info=True`` (what ``log.exception`` passes)
    becomes the exception itself, which the rendering thread could not find with ``sys.exc_info()``."""
    if event_dict.get("exc_info") is True:
        event_dict["exc_info"] = sys.exc_info()
    return event_dict


def _exception_of(record: logging.LogRecord) -> BaseException | None:
    exc_info: Any = record.exc_info
    if isinstance(record.msg, dict):
        exc_info = record.msg.get("exc_info", exc_info)
    if isinstance(exc_info, BaseException):
        return exc_info
    if isinstance(exc_info, tuple) and len(exc_info) == 3 and isinstance(exc_info[1], BaseException):
        return exc_info[1]
    return None


def _drop_exception(record: logging.LogRecord) -> None:
    record.exc_info = None
    record.exc_text = None
    if isinstance(record.msg, dict):
        record.msg = {k: v for k, v in record.msg.items() if k != "exc_info"}


class OffLoopHandler(logging.handlers.QueueHandler):
    """Puts records on a bounded queue for the listener thread; renders nothing on the caller's thread."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        """A copy of the record to hand to the other thread: its message merged with its arguments now
        (they may change later), its exception left to render there, a traceback already logged
        dropped."""
        record = copy.copy(record)
        if not isinstance(record.msg, dict) and record.args:
            record.msg = record.getMessage()
            record.args = None
        error = _exception_of(record)
        if error is not None:
            if getattr(error, _LOGGED_MARK, False):
                _drop_exception(record)
            else:  # an exception type without a __dict__ cannot be marked: it may be logged twice
                with contextlib.suppress(AttributeError):
                    setattr(error, _LOGGED_MARK, True)
        return record

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            DROPPED.inc()


def _renderer(stream: TextIO) -> Processor:
    if stream.isatty():
        return structlog.dev.ConsoleRenderer(colors=True, exception_formatter=structlog.dev.plain_traceback)
    return structlog.processors.JSONRenderer()


def configure_logging(level: str | int = "info", *, stream: TextIO | None = None) -> None:
    """Configure structlog and the standard library for this process (again: replaces the previous
    configuration). Records go to ``stream`` (standard error by default) from a listener thread."""
    global _listener
    stop_logging()
    stream = stream or sys.stderr
    numeric = level if isinstance(level, int) else logging.getLevelNamesMapping()[level.upper()]

    shared: list[Processor] = [
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            redact_secrets,
            _renderer(stream),
        ],
    )
    output = logging.StreamHandler(stream)
    output.setFormatter(formatter)
    records: queue.Queue[logging.LogRecord | None] = queue.Queue(QUEUE_SIZE)
    _listener = _Listener(records, output)

    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(OffLoopHandler(records))
    root.setLevel(numeric)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi"):
        named = logging.getLogger(name)  # uvicorn's own configuration gives these handlers of their own
        for handler in list(named.handlers):
            named.removeHandler(handler)
        named.propagate = True
        named.setLevel(logging.NOTSET)

    structlog.configure(
        processors=[
            *shared,
            capture_exc_info,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        cache_logger_on_first_use=False,
    )
    _listener.start()


def stop_logging() -> None:
    """Write out what is queued and stop the listener thread (at exit, or before configuring again)."""
    global _listener
    if _listener is not None:
        listener, _listener = _listener, None
        listener.stop()


atexit.register(stop_logging)
