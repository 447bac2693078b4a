r"""The scoring server's client connections: time limits per connection, a cap on open connections, and a drain
that answers every request it accepted (recjax/serving/server.py serves through these).

aiohttp bounds what a request may hold (its body's bytes) but not how long a client may take: a connection that
sends half its headers, or headers saying `Content-Length: 100` and never the body, kept its handler waiting for
ever. Here, per connection (`ServerOptions` in server.py, the `experiments.serve` flags of the same names):

  headers  a request's headers must arrive within `header_timeout_seconds` of its connection opening (on a
           kept-alive connection, of the request's first byte), else 408 and the connection closes;
  body     its body within `body_timeout_seconds` of its headers (the score handler's read), else 408 and close;
  idle     a kept-alive connection without a request for `idle_timeout_seconds` is closed (aiohttp's
           keepalive_timeout);
  cap      past `max_connections` open connections, a new connection is answered 503 with Retry-After as soon as
           its first bytes arrive, and closed: refused at once, never queued, and without reading the request (no
           parser, no handler), so that refusing under overload frees the CPU the accepted requests need rather
           than taking as much as answering them;
  gone     a client that hangs up before its answer (mid-body, or while its rows are scored) is counted under
           code 499 (nginx's "client closed request"), not as the server's 500.

The drain. aiohttp's own graceful shutdown (`AppRunner.cleanup`) first marks every connection closing, which
drops the bytes of bodies still arriving, and closes the listening socket with the connections the kernel has
completed but the server not yet accepted, which resets them; then it cancels the handlers that have not answered
within `shutdown_timeout`, without an answer. Under a burst (hundreds of large requests in flight at SIGTERM) every
client saw its connection drop. So `Gate.drain` does it in this order, and leaves aiohttp's cleanup only the idle
connections:
  1. stop admitting: a request whose headers arrive from now on is answered 503 + Retry-After + Connection: close;
     the connections waiting in the listening socket's backlog (completed by the kernel before the signal) are
     accepted, so they get that answer instead of a reset, and the listening socket closes;
  2. answer the requests in flight -- every request whose headers were read before the signal, its body still
     arriving or not -- and let every connection finish what it is doing (writing an answer, or reading the rest of
     a refused request's body so that its client reads the answer rather than a reset), within `drain_seconds`;
  3. past `drain_seconds`, a request still unanswered gets 503 (its handler is cancelled), and so does a connection
     whose request's headers have not all arrived; the report counts them;
  4. then close the idle connections and the application (the batcher), and wait until the answers have left.
Every response during the drain says Connection: close, so no connection outlives its answer. The report says how
many requests in flight were answered and how many were not; `python -m experiments.serve` exits 0 only when all
were.

`Connection` subclasses aiohttp's protocol (`web_protocol.RequestHandler`) for what only the protocol sees: when a
request's first byte and its complete headers arrive, when the connection opens and closes, and the linger after an
early answer.
"""

import asyncio
import contextlib
import dataclasses
import json
import socket
from collections.abc import Callable
from typing import Any

from aiohttp import web_protocol

RETRY_AFTER_SECONDS = 1  # the Retry-After of a 503: another replica (or this one, past the burst) can answer now
# How long the end of a drain waits for the answers already written to leave (sockets flushed and closed) and for
# aiohttp's cleanup of connections that are lingering; a client that stops reading cannot hold the exit longer.
CLOSE_GRACE_SECONDS = 5.0
SWEEP_SECONDS = 0.25  # how often header deadlines are checked: a 408 comes at most this late


@dataclasses.dataclass
class DrainReport:
    """What a drain did. in_flight = answered + unanswered + gone."""

    in_flight: int = 0  # requests whose headers were read before the signal and that were not answered yet
    answered: int = 0  # ... answered by their handler (200, 422, 408, ...)
    unanswered: int = 0  # ... still unanswered after drain_seconds: answered 503
    gone: int = 0  # ... whose client hung up first (499)
    refused: int = 0  # requests whose headers arrived during the drain: 503 + Retry-After
    cut_headers: int = 0  # connections still to send a request's headers after drain_seconds: 503
    seconds: float = 0.0

    @property
    def complete(self) -> bool:
        """Every request in flight at the signal got its handler's answer (or its client left)."""
        return self.unanswered == 0

    def describe(self, drain_seconds: float) -> str:
        text = (f"drained in {self.seconds:.2f} s: {self.answered} of the {self.in_flight} requests in flight "
                f"answered")
        if self.gone:
            text += f", {self.gone} clients gone before their answer"
        if self.unanswered:
            text += (f", {self.unanswered} unanswered within --drain_seconds={drain_seconds:g} (answered 503: "
                     "raise --drain_seconds to let them finish)")
        text += f"; {self.refused} requests arriving during the drain refused (503 + Retry-After)"
        if self.cut_headers:
            text += f"; {self.cut_headers} connections still to send a request's headers at the deadline (503)"
        return text


@dataclasses.dataclass(eq=False)
class InFlight:
    """One request from its headers to its answer."""

    task: asyncio.Task | None  # the aiohttp task running its handler (cancelled past the drain's deadline)
    accepted: bool  # its headers were read before the drain began: it is answered, not refused
    cut: bool = False  # cancelled past drain_seconds: answered 503


def raw_response(status: int, reason: str, message: str, retry_after: int | None = None) -> bytes:
    """An HTTP/1.1 answer with a JSON {"error": message} body that closes the connection, written straight to the
    socket where no handler runs (a request whose headers never completed)."""
    body = json.dumps({"error": message}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n")
    if retry_after is not None:
        head += f"Retry-After: {retry_after}\r\n"
    return (head + "\r\n").encode() + body


class Gate:
    """The server's open connections and requests in flight: the connection cap, the refusals, the drain.

    `metrics` is the server's Metrics (its `requests` counter and `connections` / `in_flight` gauges, which read
    this gate);
    `on_drain` callbacks run when a drain begins (the server's status, the batcher's stop-waiting)."""

    def __init__(self, options: Any, metrics: Any):
        self.options, self.metrics = options, metrics
        self.connections: set[Connection] = set()
        self.requests: set[InFlight] = set()
        self.draining = False
        self.report = DrainReport()
        self.on_drain: list[Callable[[], None]] = []
        self._changed: asyncio.Event | None = None  # made in the loop, when a drain waits on it
        # Read when /metrics is scraped, not set on every change (a request and a connection each changed them twice).
        metrics.connections.set_function(lambda: len(self.connections))
        metrics.in_flight.set_function(lambda: len(self.requests))
        self.drain_start = 0.0  # the loop's time when the drain began

    # -- connections
    def opened(self, connection: "Connection") -> bool:
        """Register a new connection; True when it is past the cap (its request is refused)."""
        self.connections.add(connection)
        return len(self.connections) > self.options.max_connections

    def closed(self, connection: "Connection") -> None:
        self.connections.discard(connection)
        self.changed()

    def changed(self) -> None:
        if self._changed is not None:
            self._changed.set()

    # -- requests
    def begin(self) -> InFlight:
        request = InFlight(asyncio.current_task(), accepted=not self.draining)
        self.requests.add(request)
        return request

    def refusal(self) -> str | None:
        """Why a request just read must be refused (503 + Retry-After), or None to answer it."""
        if self.draining:
            return "the server is shutting down; send the request again (to another replica)"
        return None

    def end(self, request: InFlight, gone: bool) -> None:
        self.requests.discard(request)
        if self.draining:
            if not request.accepted:
                self.report.refused += 1
            elif request.cut:
                self.report.unanswered += 1
            elif gone:
                self.report.gone += 1
            else:
                self.report.answered += 1
        self.changed()

    async def sweep(self) -> None:
        """Every SWEEP_SECONDS (or a quarter of the header timeout, if less), the connections past their header
        deadline get their 408. One sweep for all rather than a timer per connection: arming and cancelling an
        asyncio timer with every request costs microseconds; a look at a connection's deadline, a fraction of one."""
        loop = asyncio.get_running_loop()
        period = min(SWEEP_SECONDS, self.options.header_timeout_seconds / 4)
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            for connection in [c for c in self.connections if c.head_deadline is not None and now >= c.head_deadline]:
                connection.head_deadline = None
                connection.head_timed_out()

    # -- the drain (module doc)
    def settled(self) -> bool:
        """No request in a handler, and every connection idle (kept alive after an answer, no byte of a next
        request here) or closed: a new connection's first request, on its way, is waited for (and refused)."""
        return not self.requests and all(c.idle for c in self.connections)

    async def _wait_until(self, done: Callable[[], bool], deadline: float) -> bool:
        loop = asyncio.get_running_loop()
        self._changed = self._changed or asyncio.Event()
        while not done():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            self._changed.clear()
            # A change (a request answered, a connection closed or answered), or a look every 50 ms: a connection
            # also turns idle inside aiohttp (its linger ends) without telling us.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(remaining, 0.05))
        return True

    async def stop_accepting(self, listeners: list[tuple[asyncio.AbstractServer, socket.socket]],
                             protocol: Callable[[], "Connection"]) -> None:
        """Step 1 of the module doc; `listeners`: (the asyncio server, its listening socket) pairs; `protocol`: the
        connection factory (for the backlog's connections)."""
        loop = asyncio.get_running_loop()
        self.drain_start = loop.time()
        self.draining = True
        self.report.in_flight = sum(r.accepted for r in self.requests)
        for callback in self.on_drain:
            callback()
        for _, sock in listeners:
            # asyncio accepts in a reader callback and sets each connection up in a task; a listening server that
            # closes before that task runs makes the task fail (Server._attach), which drops the connection. So:
            # stop asyncio's accepting first, let the tasks it started run, then empty the backlog ourselves.
            loop.remove_reader(sock.fileno())
        for _ in range(3):
            await asyncio.sleep(0)
        for server, sock in listeners:
            while True:  # the kernel's completed connections, before the listening socket closes and resets them
                try:
                    accepted, _ = sock.accept()
                except OSError:  # BlockingIOError: the backlog is empty
                    break
                try:
                    await loop.connect_accepted_socket(protocol, accepted)
                except OSError:  # the client left meanwhile
                    accepted.close()
            server.close()

    async def drain(self) -> DrainReport:
        """Steps 2-3 of the module doc, after `stop_accepting`."""
        loop = asyncio.get_running_loop()
        start = self.drain_start
        deadline = start + self.options.drain_seconds
        if not await self._wait_until(self.settled, deadline):
            for request in list(self.requests):
                if request.accepted and request.task is not None and not request.task.done():
                    request.cut = True
                    request.task.cancel()  # the server's middleware answers it 503
            for connection in list(self.connections):
                if connection.awaiting_request:
                    self.report.cut_headers += 1
                    connection.refuse(503, "Service Unavailable", "the server shut down before the request's "
                                      "headers arrived; send it again (to another replica)", RETRY_AFTER_SECONDS)
            await self._wait_until(lambda: not self.requests, loop.time() + CLOSE_GRACE_SECONDS)
        self.report.seconds = loop.time() - start
        return self.report

    async def closed_all(self) -> None:
        """Step 4's last wait: every connection gone (its answer flushed to the socket), CLOSE_GRACE_SECONDS at most."""
        loop = asyncio.get_running_loop()
        await self._wait_until(lambda: not self.connections, loop.time() + CLOSE_GRACE_SECONDS)


class Connection(web_protocol.RequestHandler):
    """aiohttp's HTTP/1.1 protocol, plus the header timeout and the cap (module doc). aiohttp >= 3.9 (the serve
    extra's pin); it reads the parser's request count, the wait for the next request and the linger time, the
    attributes aiohttp's own keep-alive and shutdown logic use."""

    def __init__(self, manager: Any, gate: Gate, **kwargs: Any):
        super().__init__(manager, **kwargs)
        self.gate = gate
        self.over_cap = False  # opened past the cap: refused at its first bytes
        self.refused = False  # answered on the socket (refuse): nothing more is written or read
        self.waiting_headers = True  # between requests: the next request's headers are not all here
        self.head_started = False  # ... and some of its bytes are
        self.requests_read = 0  # requests whose headers were read
        self.head_deadline: float | None = None  # the loop's time by which the awaited headers must be here

    # -- state the drain reads
    @property
    def awaiting_request(self) -> bool:
        """A request's headers are arriving, or the connection is new: its client connected to send one (and was not
        refused already)."""
        return (self.transport is not None and not self.refused and self.waiting_headers and not self._messages
                and (self.head_started or self.requests_read == 0))

    @property
    def idle(self) -> bool:
        """Kept alive after an answer, waiting for a request, no byte of one here: a connection the drain may close
        (a client sending on it just then loses the race every HTTP/1.1 client must expect on a kept-alive
        connection)."""
        if self.transport is None:
            return True
        waiter = self._waiter
        return (waiter is not None and not waiter.done() and self.requests_read > 0 and not self.head_started
                and not self._messages)

    # -- aiohttp's protocol callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.over_cap = self.gate.opened(self)
        self._start_head_clock()  # a new connection's first request: its headers within the timeout

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_head_clock()
        self.gate.closed(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.over_cap or self.refused:
            if data and not self.refused:
                self.refuse(503, "Service Unavailable", "too many open connections (--max_connections="
                            f"{self.gate.options.max_connections}); send the request again later",
                            RETRY_AFTER_SECONDS, read_rest=True)
            return  # the rest of what it sends is dropped
        if data and self.waiting_headers and not self.head_started:
            self.head_started = True
            if self.head_deadline is None:  # on a kept-alive connection: from the request's first byte
                self._start_head_clock()
        parsed = self._request_count
        super().data_received(data)
        if self._request_count != parsed:  # a request's headers are complete: its handler takes over
            self.requests_read += self._request_count - parsed
            self.waiting_headers = self.head_started = False
            self._stop_head_clock()

    async def finish_response(self, request: Any, resp: Any, start_time: float | None) -> tuple[Any, bool]:
        answered = await super().finish_response(request, resp, start_time)
        # The connection waits for its next request -- unless it closes now, or reads the rest of this request's
        # body first (aiohttp's linger after an early answer), whose bytes are not a next request's headers.
        if resp.keep_alive and request.content.is_eof():
            self.waiting_headers, self.head_started = True, False
        self.gate.changed()
        return answered

    # -- what the server does to a connection
    def stop_reading(self) -> None:
        """Close right after this answer instead of reading the rest of the body (a client past the body timeout
        would only hold the connection longer)."""
        self._lingering_time = 0.0

    def refuse(self, status: int, reason: str, message: str, retry_after: int | None = None,
               read_rest: bool = False) -> None:
        """Answer `status` straight on the socket (no request is being answered on it) and close: at once, or with
        `read_rest` after the client closes (our side is shut for writing; what it still sends is dropped, since
        closing with its bytes unread would reset the connection and could lose the answer), or when the header
        timeout comes."""
        if self.transport is None:
            return
        if self.refused:
            self.force_close()
            return
        self.refused = True
        self.transport.write(raw_response(status, reason, message, retry_after))
        self.gate.metrics.requests.labels("other", str(status)).inc()
        if read_rest and self.transport.can_write_eof():
            self.transport.write_eof()
            self._start_head_clock()  # the client has this long to close
        else:
            self.force_close()  # the transport closes once the answer is flushed

    def _start_head_clock(self) -> None:
        self.head_deadline = self._loop.time() + self.gate.options.header_timeout_seconds  # Gate.sweep checks it

    def _stop_head_clock(self) -> None:
        self.head_deadline = None

    def head_timed_out(self) -> None:
        if self.refused:  # answered already: the client did not close
            self.force_close()
        elif self.waiting_headers and not self._messages:
            self.refuse(408, "Request Timeout", "the request's headers did not arrive within "
                        f"--header_timeout_seconds={self.gate.options.header_timeout_seconds:g}")
