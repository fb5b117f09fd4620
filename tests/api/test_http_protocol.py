"""The guarded HTTP protocol (api/http_protocol.py) over real sockets, under uvicorn in a thread with a
tiny ASGI app: deadlines for request heads and bodies, the connection cap, problem+json 400s, aggregated
log lines; and the parts of uvicorn it relies on, so that an upgrade that moves them fails here."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import select
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

import pytest
import uvicorn
from prometheus_client import REGISTRY
from structlog.testing import capture_logs
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from api import http_protocol
from api.http_protocol import UVICORN_CONTRACT, GuardedHttpToolsProtocol, ServingLimits

PROBLEM_JSON = "application/problem+json"
GENEROUS_S = 10.0  # a bound on waits that should end much sooner, never an expectation


BIG = 4 * 1024 * 1024  # /big's body: more than a connection's write buffer and socket buffers hold


class App:
    """``/fast`` answers at once, ``/echo`` with its body, ``/hold`` once released, ``/big`` with
    ``BIG`` bytes, ``/endless`` with a body that never ends until the client is gone; WebSockets are
    refused. Counts what the tests look at."""

    def __init__(self) -> None:
        self.holding = 0
        self.reading = 0  # /echo requests begun
        self.disconnects = 0  # /echo requests whose body never came: the app heard http.disconnect
        self.streams_ended = 0  # /endless responses that ended because the client was gone
        self.release = threading.Event()

    async def __call__(
        self,
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[dict[str, Any]]],
        send: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] == "websocket":
            await receive()
            await send({"type": "websocket.close"})
            return
        body = b"ok"
        if scope["path"] == "/endless":
            await self._endless(receive, send)
            return
        if scope["path"] == "/big":
            body = b"x" * BIG
        elif scope["path"] == "/echo":
            self.reading += 1
            body = b""
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.disconnects += 1
                    return
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
        elif scope["path"] == "/hold":
            self.holding += 1
            await asyncio.to_thread(self.release.wait)
            self.holding -= 1
        headers = [(b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _endless(
        self,
        receive: Callable[[], Awaitable[dict[str, Any]]],
        send: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> None:
        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        gone = asyncio.ensure_future(disconnected())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        while not gone.done():
            await send({"type": "http.response.body", "body": b"x" * 65_536, "more_body": True})
            await asyncio.sleep(0)  # a send to a lost connection returns at once
        self.streams_ended += 1


def guarded(
    head_timeout_s: float = 30.0,
    body_timeout_s: float = 30.0,
    max_connections: int = 1_000,
    write_timeout_s: float = 30.0,
) -> type[GuardedHttpToolsProtocol]:
    """The protocol with its limits given here instead of read from the environment."""
    limits = ServingLimits(head_timeout_s, body_timeout_s, max_connections, write_timeout_s)
    return type("Guarded", (GuardedHttpToolsProtocol,), {"limits": limits})


@contextlib.contextmanager
def serving(protocol: type[HttpToolsProtocol], app: App | None = None) -> Iterator[int]:
    """uvicorn with ``protocol`` on 127.0.0.1 in a thread; the port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app or App(), http=protocol, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + GENEROUS_S
    while not server.started:
        assert thread.is_alive(), "uvicorn did not start"
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield int(sock.getsockname()[1])
    finally:
        if app is not None:
            app.release.set()
        server.should_exit = True
        thread.join(GENEROUS_S)
        sock.close()


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def problem(self) -> dict[str, Any]:
        assert self.headers["content-type"] == PROBLEM_JSON, self
        document: dict[str, Any] = json.loads(self.body)
        assert document["status"] == self.status
        return document


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=GENEROUS_S)


def connect_small_window(port: int) -> socket.socket:
    """A connection whose receive buffer (so its TCP window) is 4 KiB: a server's writes back up soon."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(GENEROUS_S)
    sock.connect(("127.0.0.1", port))
    return sock


def reset(sock: socket.socket) -> bool:
    """The server reset the connection (whatever it had sent before is read and ignored); False when it
    closed it in order or the read timed out."""
    try:
        while sock.recv(65_536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return False


def read_answer(sock: socket.socket) -> Answer:
    """One response (with a Content-Length) from the connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65_536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65_536)
        assert chunk, f"closed within a response: {data!r}"
        body += chunk
    return Answer(int(status_line.split()[1]), headers, body)


def closed(sock: socket.socket) -> bool:
    """The server closed the connection: end of file, with nothing more before it."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def still_open(sock: socket.socket) -> bool:
    """Nothing has arrived and the server has not closed the connection (as of now)."""
    return not select.select([sock], [], [], 0)[0]


def get(path: str = "/fast") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


def served(port: int) -> bool:
    with connect(port) as sock:
        sock.sendall(get())
        return read_answer(sock).status == 200


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + GENEROUS_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


# --- uvicorn's side of the bargain -----------------------------------------------------------------


def test_uvicorn_still_has_what_the_protocol_relies_on() -> None:
    for name in UVICORN_CONTRACT["methods"]:
        assert name in vars(HttpToolsProtocol), f"uvicorn's HttpToolsProtocol no longer defines {name}"
        theirs = inspect.signature(getattr(HttpToolsProtocol, name))
        ours = inspect.signature(getattr(GuardedHttpToolsProtocol, name))
        assert list(ours.parameters) == list(theirs.parameters), name
    loop = asyncio.new_event_loop()
    try:
        protocol = HttpToolsProtocol(
            config=uvicorn.Config(App()), server_state=ServerState(), app_state={}, _loop=loop
        )
    finally:
        loop.close()
    for name in UVICORN_CONTRACT["protocol_attributes"]:
        assert hasattr(protocol, name), f"uvicorn's HttpToolsProtocol no longer has {name}"
    assert hasattr(ServerState(), "default_headers")
    assert hasattr(ServerState(), "connections")


def test_uvicorn_calls_every_override() -> None:
    """Each method the protocol overrides is still called by uvicorn where the protocol expects it, and
    a request's cycle still carries the attributes the protocol reads and sets."""
    called: set[str] = set()
    cycles: list[RequestResponseCycle] = []

    def recording(name: str) -> Callable[..., Any]:
        original = getattr(GuardedHttpToolsProtocol, name)

        def record(self: GuardedHttpToolsProtocol, *args: Any, **kwargs: Any) -> Any:
            called.add(name)
            if name == "on_response_complete":
                cycles.append(self.cycle)
            return original(self, *args, **kwargs)

        return record

    methods = {name: recording(name) for name in UVICORN_CONTRACT["methods"]}
    protocol = type("Recording", (guarded(),), methods)
    with serving(protocol) as port:
        idle_at_shutdown = connect(port)
        assert served(port)  # connection_made ... on_response_complete, connection_lost
        with connect(port) as sock:
            sock.sendall(b"GET /fast HTTP/1.1\r\nHost: x\r\nX-Bad: a\x01b\r\n\r\n")
            assert read_answer(sock).status == 400  # send_400_response
        with connect(port) as sock:
            sock.sendall(
                b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
            )
            assert read_answer(sock).status == 403  # handle_websocket_upgrade; the app refused it
        with connect_small_window(port) as sock:
            sock.sendall(get("/big"))  # more than the write buffer holds: pause_writing
            assert len(read_answer(sock).body) == BIG  # taken: resume_writing
        idle_at_shutdown.sendall(get())
        assert read_answer(idle_at_shutdown).status == 200
    # Leaving ``serving`` stopped the server with a connection open: shutdown.
    assert closed(idle_at_shutdown)
    idle_at_shutdown.close()
    assert called == set(UVICORN_CONTRACT["methods"])
    assert cycles
    for name in UVICORN_CONTRACT["cycle_attributes"]:
        assert hasattr(cycles[0], name), f"uvicorn's RequestResponseCycle no longer has {name}"


# --- malformed requests --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_bytes",
    [
        pytest.param(b"GET /fast HTTP/1.1\r\nHost: x\r\nX-Bad: a\x01b\r\n\r\n", id="control-character"),
        pytest.param(b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03", id="tls-to-the-http-port"),
        pytest.param(b"GET /fast HTTP/1.1 trailing\r\nHost: x\r\n\r\n", id="request-line"),
        pytest.param(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1x\r\n\r\n", id="content-length"),
        pytest.param(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", id="chunk-size"
        ),
    ],
)
def test_a_malformed_request_is_answered_400_problem_json(request_bytes: bytes) -> None:
    app = App()
    with serving(guarded(), app) as port:
        with connect(port) as sock:
            sock.sendall(request_bytes)
            answer = read_answer(sock)
            assert answer.status == 400
            assert answer.problem()["code"] == "bad_request"
            assert answer.headers["connection"] == "close"
            assert closed(sock)
        assert served(port)
    assert app.disconnects == app.reading  # an app already reading the body was told, not left waiting


# --- deadlines -------------------------------------------------------------------------------------------


def test_a_connection_that_sends_nothing_is_closed_after_the_head_deadline() -> None:
    with serving(guarded(head_timeout_s=0.3)) as port, connect(port) as sock:
        answer = read_answer(sock)
        assert answer.status == 408
        assert answer.problem()["code"] == "request_timeout"
        assert closed(sock)


def test_a_head_trickling_in_is_closed_after_the_head_deadline() -> None:
    """Bytes keep coming, a header line at a time, yet the head never ends: the deadline is for the
    whole head, not for silence."""
    with serving(guarded(head_timeout_s=0.5)) as port, connect(port) as sock:
        sock.sendall(b"GET /fast HTTP/1.1\r\n")
        lines = 0
        while still_open(sock):
            assert lines < GENEROUS_S / 0.05, "never closed"
            sock.sendall(b"X-Slow: %d\r\n" % lines)
            lines += 1
            time.sleep(0.05)
        assert lines > 1
        answer = read_answer(sock)
        assert (answer.status, answer.problem()["code"]) == (408, "request_timeout")
        assert closed(sock)


def test_the_next_head_on_a_kept_connection_has_its_deadline_too() -> None:
    with serving(guarded(head_timeout_s=0.3)) as port, connect(port) as sock:
        sock.sendall(get())
        assert read_answer(sock).status == 200
        sock.sendall(b"GET /fast HTTP/1.1\r\nHost")
        answer = read_answer(sock)
        assert (answer.status, answer.problem()["code"]) == (408, "request_timeout")
        assert closed(sock)


def test_a_kept_connection_idle_between_requests_is_not_cut_by_the_head_deadline() -> None:
    """Between requests uvicorn's keep-alive timeout (5 s) applies, not the head deadline."""
    with serving(guarded(head_timeout_s=0.3)) as port, connect(port) as sock:
        for _ in range(2):
            sock.sendall(get())
            assert read_answer(sock).status == 200
            time.sleep(0.6)
        assert still_open(sock)


def test_a_body_that_never_ends_is_answered_408_and_the_app_told() -> None:
    app = App()
    with serving(guarded(body_timeout_s=0.3), app) as port:
        with connect(port) as sock:
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
            answer = read_answer(sock)
            assert (answer.status, answer.problem()["code"]) == (408, "request_timeout")
            assert "body" in answer.problem()["detail"]
            assert closed(sock)  # and no 200 from the app after it
        wait_for(lambda: app.disconnects == 1, "the app kept waiting for the body")
        assert served(port)


def test_a_body_sent_whole_after_a_pause_under_the_deadline_is_served() -> None:
    with serving(guarded(head_timeout_s=0.3, body_timeout_s=5.0)) as port, connect(port) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\nabc")
        time.sleep(0.5)  # longer than the head deadline, which no longer applies
        sock.sendall(b"def")
        answer = read_answer(sock)
        assert (answer.status, answer.body) == (200, b"abcdef")


def test_timeouts_are_logged_once_per_window_and_counted() -> None:
    def closed_total() -> float:
        labels = {"reason": "head_timeout"}
        return REGISTRY.get_sample_value("lockledger_http_connections_closed_total", labels) or 0.0

    before = closed_total()
    with (
        pytest.MonkeyPatch.context() as patch,
        capture_logs() as logs,
        serving(guarded(head_timeout_s=0.2)) as port,
    ):
        patch.setattr(http_protocol, "LOG_WINDOW_S", 0.3)
        sockets = [connect(port) for _ in range(12)]
        for sock in sockets:
            assert read_answer(sock).status == 408
            sock.close()

        def logged() -> list[MutableMapping[str, Any]]:
            return [entry for entry in logs if entry["event"].startswith("request head not received")]

        wait_for(lambda: sum(entry["count"] for entry in logged()) == 12, f"not all logged: {logs}")
        assert len(logged()) < 12
        assert all(entry["log_level"] == "warning" for entry in logged())
    assert closed_total() - before == 12


# --- the write deadline ---------------------------------------------------------------------------------


def test_a_client_that_does_not_take_its_response_is_cut_and_logged_once() -> None:
    def closed_total() -> float:
        labels = {"reason": "write_timeout"}
        return REGISTRY.get_sample_value("lockledger_http_connections_closed_total", labels) or 0.0

    app = App()
    before = closed_total()
    with capture_logs() as logs, serving(guarded(write_timeout_s=0.3), app) as port:
        sock = connect_small_window(port)
        sock.sendall(get("/endless"))  # and never read
        wait_for(lambda: app.streams_ended == 1, "the app was not told that the client is gone")
        assert reset(sock)  # SO_LINGER 0: nothing more is sent, nothing kept for it
        sock.close()
        assert served(port)
    cut = [entry for entry in logs if entry.get("reason") == "write_timeout"]
    assert len(cut) == 1, logs
    assert cut[0]["path"] == "/endless"
    assert cut[0]["log_level"] == "warning"
    assert closed_total() - before == 1


def test_a_slow_client_that_takes_its_response_is_not_cut() -> None:
    app = App()
    with serving(guarded(write_timeout_s=0.3), app) as port, connect_small_window(port) as sock:
        sock.sendall(get("/big"))
        time.sleep(0.1)  # the write buffer fills; the deadline is armed
        body = read_answer(sock).body  # drains it again and again, each time within the deadline
        assert len(body) == BIG


# --- the connection cap ----------------------------------------------------------------------------------


def test_at_the_cap_a_newcomer_displaces_the_oldest_connection_without_a_request() -> None:
    with serving(guarded(max_connections=4)) as port:
        silent = [connect(port) for _ in range(4)]
        assert served(port)  # the fifth
        answer = read_answer(silent[0])  # the longest waiting
        assert (answer.status, answer.problem()["code"]) == (503, "unavailable")
        assert answer.headers["retry-after"] == "1"
        assert closed(silent[0])
        assert all(still_open(sock) for sock in silent[1:])
        for sock in silent:
            sock.close()


def test_displacement_order_head_then_body_then_idle() -> None:
    app = App()
    with serving(guarded(max_connections=4), app) as port:
        idle = [connect(port) for _ in range(2)]
        for sock in idle:
            sock.sendall(get())
            assert read_answer(sock).status == 200
        body = connect(port)
        body.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
        wait_for(lambda: app.reading == 1, "the body's request did not begin")
        head = connect(port)
        head.sendall(b"GET /fast HTTP/1.1\r\nHost")
        newcomers = []
        for displaced, answered in ((head, True), (body, True), (idle[0], False)):
            newcomer = connect(port)
            newcomer.sendall(get())
            assert read_answer(newcomer).status == 200
            newcomers.append(newcomer)
            if answered:
                answer = read_answer(displaced)
                assert (answer.status, answer.problem()["code"]) == (503, "unavailable")
            assert closed(displaced)  # an idle one closed without a word, as a keep-alive timeout would
        wait_for(lambda: app.disconnects == 1, "the app kept waiting for the displaced body")
        assert still_open(idle[1])
        for sock in [*idle, body, head, *newcomers]:
            sock.close()


def test_at_the_cap_with_every_connection_served_a_newcomer_is_refused_503() -> None:
    app = App()
    with serving(guarded(max_connections=4), app) as port:
        holding = [connect(port) for _ in range(4)]
        for sock in holding:
            sock.sendall(get("/hold"))
        wait_for(lambda: app.holding == 4, "the requests did not all begin")
        with connect(port) as refused:
            answer = read_answer(refused)
            assert (answer.status, answer.problem()["code"]) == (503, "unavailable")
            assert answer.headers["retry-after"] == "1"
            assert closed(refused)
        app.release.set()
        for sock in holding:
            assert read_answer(sock).status == 200  # the requests being served were left alone
            sock.close()
        wait_for(lambda: served(port), "not served once below the cap")


def test_the_default_cap_stays_below_the_open_file_limit() -> None:
    from service.config import Settings

    settings = Settings()
    assert http_protocol.connection_cap(settings, 1_024) < 1_024 - settings.pool_max_size
    assert http_protocol.connection_cap(settings, 256) < 256 - settings.pool_max_size
    assert http_protocol.connection_cap(Settings(http_max_connections=100), 1_024) == 100
    assert http_protocol.connection_cap(Settings(http_max_connections=5_000), 1_024) < 1_024
    assert http_protocol.connection_cap(Settings(http_max_connections=5_000), None) == 5_000
