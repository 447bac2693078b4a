r"""The scoring server: an export (recjax/serving/loader.py) behind HTTP, with dynamic batching and Prometheus metrics.

    python -m experiments.serve --model=DIR --port=8500 [--max_batch=64 --max_wait_ms=2]

    POST /v1/score   {"rows": [row, ...]} -> {"scores": [p or null, ...], "errors": [{"row", "field", "error"}]}
                     and a Server-Timing header: the server's own milliseconds (total) and its model call's (forward)
                     a row is a raw line in the dataset's format or {"dense": [...], "ids": {feature: id | [ids]}}
                     (loader.py); 200 when every row scored, 422 when some rows have errors (the others are scored),
                     400 for a body that is not {"rows": [...]}, 413 past --max_rows rows or --max_body_bytes bytes
    GET  /healthz    200 {"status": "ok", ...} once the model is loaded and compiled; 503 while starting / draining
    GET  /metrics    Prometheus text: requests by code, rows scored, row errors, request latency, batch rows and
                     forward time histograms, queued rows, the batching settings in force, open connections and
                     requests in flight
    any              408 when a request's headers or body arrive too slowly, 503 + Retry-After past the connection
                     cap or while draining (below)

Why aiohttp: one maintained package that is both an asyncio HTTP server and the client the load generator
(benchmarks/serving.py) uses; the batcher is a coroutine beside the handlers; body limits (`client_max_size`) are
built in, and its protocol class takes the time limits it lacks (connections.py). uvicorn + an ASGI framework would
be two packages plus a separate HTTP client. (aiohttp's own graceful shutdown drops requests in flight under load:
connections.py says why, and drains itself.)

Batching (what TF Serving / Triton call max_batch_size / max_queue_delay): requests' valid rows queue; the batcher
takes the oldest and waits until `max_batch` rows are queued or the oldest has waited `max_wait_ms`, then scores
whole requests (FIFO, up to `max_batch` rows; a larger request alone, in chunks) in one call on a worker thread while
the next batch gathers. Every call runs at one batch shape (`batch_shapes="fixed"`: padded to the largest batch), so
a row's score is a function of the row alone, never of what it was batched with (XLA:CPU's kernels change the last
bit of a row's score with the batch shape); "pow2" pads to the next power of two instead (less work per small
batch, scores then agree across batchings to ~1 ulp).

Scheduling (`scheduler="adaptive"`): `AdaptiveBatching` sets how many rows a call may take from the warm-up's call
times (`--max_batch` is then the cap) and, every quarter second, how long to wait for more from the measured arrival
rate and p99 against a target (DeepRecSys's per-load batching, Gupta et al., ISCA 2020).

Connections (recjax/serving/connections.py): a request's headers must arrive within `header_timeout_seconds` and
its body within `body_timeout_seconds` (else 408), an idle kept-alive connection closes after `idle_timeout_seconds`,
a connection past `max_connections` gets 503 + Retry-After at once, and a client that hangs up before its answer is
counted as code 499. On SIGTERM (or SIGINT) the server stops accepting connections, answers requests that arrive
from then on with 503 + Retry-After, scores what is queued at once, answers every request in flight -- those whose
bodies are still arriving too -- within `drain_seconds` (503 for any it could not), and exits; `serve` returns the
drain's report (`DrainReport`).

Tiered tables (rows in RAM + disk, issue 26) plug in as another model object with the loader's `encode` /
`score_arrays`; a model with `cache_stats()` (hits, lookups) also gets `recjax_serving_table_cache_hit_ratio`.
"""

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import math
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import prometheus_client as prom
from aiohttp import web

from recjax.errors import ConfigError
from recjax.serving.connections import CLOSE_GRACE_SECONDS, RETRY_AFTER_SECONDS, Connection, DrainReport, Gate
from recjax.serving.loader import EncodedRows, next_power_of_two

BATCH_SHAPES = ("fixed", "pow2")
SCHEDULERS = ("fixed", "adaptive")
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5,
                   1.0, 2.0, 5.0)


@dataclasses.dataclass
class ServerOptions:
    max_batch: int = 64  # rows per model call (also the compiled batch shape with batch_shapes="fixed")
    max_wait_ms: float = 2.0  # how long the oldest queued request may wait for more rows
    max_rows: int = 1024  # rows per request
    max_body_bytes: int = 4 << 20  # bytes per request body
    batch_shapes: str = "fixed"  # "fixed" (every call at max_batch) or "pow2"
    scheduler: str = "fixed"  # "adaptive": tune max_batch / max_wait_ms online (AdaptiveBatching)
    p99_target_ms: float = 20.0  # the adaptive scheduler's target
    drain_seconds: float = 30.0  # on SIGTERM, wait this long at most for requests in flight
    # Per connection (connections.py). The defaults leave a slow but live client room (a 4 MiB body at ~150 KB/s)
    # and cut a stalled one within seconds; the idle timeout is nginx's keepalive_timeout default. The cap bounds
    # the sockets (file descriptors) and memory connections hold, a few KB each idle, above the thousands an
    # open-loop client opens against a saturated 2-core server (benchmarks/RESULTS.md, the server's connections).
    header_timeout_seconds: float = 10.0  # a request's headers within this of its connection (or first byte): else 408
    body_timeout_seconds: float = 30.0  # its body within this of its headers: else 408
    idle_timeout_seconds: float = 75.0  # a kept-alive connection without a request this long is closed
    max_connections: int = 4096  # open connections at most; one past it: 503 + Retry-After at once

    def check(self) -> None:
        for name in ("max_batch", "max_rows", "max_body_bytes", "max_connections"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"--{name}", f"must be >= 1, got {getattr(self, name)}")
        for name in ("max_wait_ms", "drain_seconds"):
            value = float(getattr(self, name))
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"--{name}", f"must be a finite number >= 0, got {value}")
        for name in ("p99_target_ms", "header_timeout_seconds", "body_timeout_seconds", "idle_timeout_seconds"):
            value = float(getattr(self, name))
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"--{name}", f"must be a finite number > 0, got {value}")
        if self.batch_shapes not in BATCH_SHAPES:
            raise ConfigError("--batch_shapes", f"must be one of {list(BATCH_SHAPES)}, got {self.batch_shapes!r}")
        if self.scheduler not in SCHEDULERS:
            raise ConfigError("--scheduler", f"must be one of {list(SCHEDULERS)}, got {self.scheduler!r}")


class AdaptiveBatching:
    """Online choice of the batching for the load of the moment, against a p99 latency target.

    DeepRecSys (Gupta et al., ISCA 2020, Sec. 5) climbs the batching per load while the tail target allows: a call
    of b rows costs far less than b calls of one, and the CPU that saves is what the next requests need. The
    batcher already batches for free what queues while a call runs; what is left to choose is whether to *wait* for
    more rows, and how long. Per window (`window` requests, or `period_s` seconds with at least `min_requests`) the
    scheduler measures the p99 latency and the arrival rate lambda (rows/s), and sets its wait on a ladder of
    `rungs` x target (0, 0.5, 1, 2, 4 ms for a 20 ms target):
      * no wait while lambda x the top rung < 1: even the longest wait would gather less than one more row, so
        waiting would only add itself to the latency (at low load a request runs alone);
      * one rung up on a tail under `slack` x target (the target has room: batching now saves the CPU a rise in
        load needs) and on a tail over the target (on two cores a loaded server's tail is its calls and requests
        queueing for the CPU, and fewer, fuller calls free it; the top rung bounds what the wait itself adds);
      * a tail between the two: hold.
    Rules that shrank the wait on a tail over the target (halving it; perturb-and-observe on the tail) waited too
    little at the loads where waiting pays, and did not beat a fixed 4 ms wait side by side (benchmarks/RESULTS.md).
    A call takes every queued row up to `max_batch`: the largest batch whose call fit target / 4 when the warm-up
    timed them (the cap if none did). It is fixed: under load the calls slow down because the requests themselves
    take the cores, and shrinking the batch then means more calls and slower ones still. The worker's busy share
    (seconds in model calls / window seconds) and the event loop thread's (its CPU seconds / window seconds:
    receiving, parsing, encoding and answering requests) are measured for /metrics; rules that decided on them lost
    to the grid side by side (benchmarks/RESULTS.md).
    """

    def __init__(self, shape_of: dict[int, int], target_ms: float, call_s: dict[int, float] | None = None,
                 window: int = 200, period_s: float = 0.25, min_requests: int = 20,
                 rungs: tuple[float, ...] = (0.0, 1 / 40, 1 / 20, 1 / 10, 1 / 5), slack: float = 0.5):
        # shape_of: the batch sizes to choose from (powers of two up to the cap) -> the shape a call of that many
        # rows runs at (the batcher's `shape_for`).
        self.target_ms = target_ms
        self.window, self.period_s, self.min_requests = window, period_s, min_requests
        self.waits_ms, self.slack = [r * target_ms for r in rungs], slack
        fits = [b for b in shape_of if 1e3 * (call_s or {}).get(shape_of[b], 0.0) <= target_ms / 4]
        self.max_batch = max(fits) if fits else max(shape_of)
        self.rung = 0  # the wait in force: waits_ms[rung]
        self.busy_shares = (0.0, 0.0)  # (worker, event loop) in the last window
        self.latencies: list[float] = []
        self.rows, self.busy_s = 0, 0.0
        self.window_start = time.perf_counter()
        self.loop_cpu_start: float | None = None  # the loop thread's CPU seconds when the window opened
        # (p99 ms, rows/s, worker share, loop share, fill_rows, max_batch, max_wait_ms) after each window
        self.decisions: list[tuple[float, float, float, float, int, int, float]] = []

    @property
    def max_wait_ms(self) -> float:
        return self.waits_ms[self.rung]

    @property
    def fill_rows(self) -> int:
        """The rows a call waits for: up to the cap while waiting (the wait decides), one otherwise."""
        return self.max_batch if self.max_wait_ms > 0 else 1

    def record_forward(self, seconds: float) -> None:
        """One model call's seconds (on the worker thread): the worker's busy time."""
        self.busy_s += seconds

    def record_request(self, seconds: float, rows: int, now: float | None = None,
                       loop_cpu: float | None = None) -> bool:
        """One answered request (on the event loop's thread); `now` and `loop_cpu` (the thread's CPU seconds) are
        read here unless given. True when it closed a window (and decided)."""
        loop_cpu = time.thread_time() if loop_cpu is None else loop_cpu
        if self.loop_cpu_start is None:  # the first request (the scheduler is made on the worker thread)
            self.loop_cpu_start = loop_cpu
        self.latencies.append(seconds)
        self.rows += rows
        now = time.perf_counter() if now is None else now
        elapsed = now - self.window_start
        count = len(self.latencies)
        if count >= self.window or (elapsed >= self.period_s and count >= self.min_requests):
            elapsed = max(elapsed, 1e-9)
            self.decide(float(np.percentile(self.latencies, 99)) * 1e3, self.rows / elapsed, self.busy_s / elapsed,
                        (loop_cpu - self.loop_cpu_start) / elapsed)
            self.latencies, self.rows, self.busy_s, self.window_start = [], 0, 0.0, now
            self.loop_cpu_start = loop_cpu
            return True
        return False

    def decide(self, p99_ms: float, rows_per_s: float, busy_share: float = 0.0, loop_share: float = 0.0) -> None:
        top = len(self.waits_ms) - 1
        if rows_per_s * self.waits_ms[top] / 1e3 < 1:
            self.rung = 0
        elif p99_ms < self.slack * self.target_ms or p99_ms > self.target_ms:
            self.rung = min(top, self.rung + 1)
        self.busy_shares = (busy_share, loop_share)
        self.decisions.append((p99_ms, rows_per_s, busy_share, loop_share, self.fill_rows, self.max_batch,
                               self.max_wait_ms))


class Metrics:
    """The server's Prometheus metrics, in a registry of its own."""

    def __init__(self, model: Any, options: ServerOptions):
        self.registry = registry = prom.CollectorRegistry()
        self.requests = prom.Counter("recjax_serving_requests", "HTTP requests by path and status code (499: the "
                                     "client hung up before its answer)",
                                     ["path", "code"], registry=registry)
        self.rows = prom.Counter("recjax_serving_rows_scored", "Rows scored", registry=registry)
        self.row_errors = prom.Counter("recjax_serving_row_errors", "Rows refused with an error", registry=registry)
        self.latency = prom.Histogram("recjax_serving_request_latency_seconds", "POST /v1/score latency, received "
                                      "to answered", buckets=LATENCY_BUCKETS, registry=registry)
        self.batch_rows = prom.Histogram("recjax_serving_batch_rows", "Rows per model call (before padding)",
                                         buckets=tuple(2**k for k in range(int(math.log2(options.max_batch)) + 2)),
                                         registry=registry)
        self.forward = prom.Histogram("recjax_serving_forward_seconds", "Model call time per batch",
                                      buckets=LATENCY_BUCKETS, registry=registry)
        self.queued = prom.Gauge("recjax_serving_queued_rows", "Rows waiting for a batch", registry=registry)
        self.max_batch = prom.Gauge("recjax_serving_max_batch", "max_batch in force", registry=registry)
        self.fill_rows = prom.Gauge("recjax_serving_fill_rows", "Rows the batcher waits for (max_batch unless the "
                                    "adaptive scheduler chose fewer)", registry=registry)
        self.max_wait = prom.Gauge("recjax_serving_max_wait_seconds", "max_wait_ms in force, in seconds",
                                   registry=registry)
        self.busy = prom.Gauge("recjax_serving_busy_share", "The adaptive scheduler's last window: the share of time "
                               "the worker spent in model calls, and the event loop's thread on the CPU", ["thread"],
                               registry=registry)
        self.connections = prom.Gauge("recjax_serving_open_connections", "Client connections open",
                                      registry=registry)
        self.in_flight = prom.Gauge("recjax_serving_requests_in_flight", "Requests whose headers were read and that "
                                    "are not answered yet", registry=registry)
        if hasattr(model, "cache_stats"):  # tiered tables: rows served from the RAM cache / rows looked up
            def ratio() -> float:
                hits, lookups = model.cache_stats()
                return hits / lookups if lookups else float("nan")

            prom.Gauge("recjax_serving_table_cache_hit_ratio", "Table rows found in the RAM cache",
                       registry=registry).set_function(ratio)

    def render(self) -> bytes:
        return prom.generate_latest(self.registry)


def _powers_of_two(cap: int) -> list[int]:
    """1, 2, 4, ... up to `cap` (and `cap` itself): the batch sizes of power-of-two shapes."""
    return sorted({min(cap, 2**k) for k in range(int(math.ceil(math.log2(cap))) + 1)})


@dataclasses.dataclass
class _Pending:
    rows: EncodedRows
    future: asyncio.Future
    arrived: float


class Batcher:
    """Queues requests' encoded rows and scores them in batches on one worker thread (module doc)."""

    def __init__(self, model: Any, options: ServerOptions, metrics: Metrics):
        self.model, self.options, self.metrics = model, options, metrics
        self.queue: collections.deque[_Pending] = collections.deque()
        self.queued_rows = 0
        self.wakeup = asyncio.Event()
        self.draining = False
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="recjax-score")
        self.adaptive: AdaptiveBatching | None = None  # made by `warm_up`, from the calls' measured times

    @property
    def max_batch(self) -> int:
        """The most rows one call takes from the queue."""
        return self.adaptive.max_batch if self.adaptive else self.options.max_batch

    @property
    def fill_rows(self) -> int:
        """The rows the batcher waits for (up to max_wait) before a call."""
        return self.adaptive.fill_rows if self.adaptive else self.options.max_batch

    @property
    def max_wait_s(self) -> float:
        return (self.adaptive.max_wait_ms if self.adaptive else self.options.max_wait_ms) / 1e3

    def shapes(self) -> list[int]:
        """The batch shapes calls run at (compiled at start)."""
        cap = self.options.max_batch
        return [cap] if self.options.batch_shapes == "fixed" else _powers_of_two(cap)

    def shape_for(self, n: int) -> int:
        cap = self.options.max_batch
        return cap if self.options.batch_shapes == "fixed" else min(cap, next_power_of_two(n))

    def warm_up(self) -> None:
        """Compile every batch shape before the first request (on the worker thread), and time a few calls of each
        for the adaptive scheduler's first choices."""
        spec = self.model.features
        call_s = {}
        for size in self.shapes():
            times = []
            for _ in range(4):  # the first call compiles
                t0 = time.perf_counter()
                self.model.score_arrays(np.zeros((1, self.model.num_dense), np.float32),
                                        {f["name"]: np.zeros((1, f["bag_size"]), np.int32) for f in spec},
                                        {f["name"]: np.zeros(1, np.int32) for f in spec}, pad_to=size)
                times.append(time.perf_counter() - t0)
            call_s[size] = float(np.median(times[1:]))
        if self.options.scheduler == "adaptive":
            self.adaptive = AdaptiveBatching({n: self.shape_for(n) for n in _powers_of_two(self.options.max_batch)},
                                             self.options.p99_target_ms, call_s)

    async def submit(self, rows: EncodedRows) -> tuple[np.ndarray, float]:
        """(the rows' scores, the seconds of the model call(s) that scored them)."""
        future = asyncio.get_running_loop().create_future()
        self.queue.append(_Pending(rows, future, time.perf_counter()))
        self.queued_rows += rows.size
        self.metrics.queued.set(self.queued_rows)
        self.wakeup.set()
        return await future

    def drain(self) -> None:
        """Stop waiting for fuller batches: score what is queued now (shutdown)."""
        self.draining = True
        self.wakeup.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.queue:
                self.wakeup.clear()
                await self.wakeup.wait()
            deadline = self.queue[0].arrived + self.max_wait_s
            while self.queued_rows < self.fill_rows and not self.draining:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                self.wakeup.clear()
                try:
                    await asyncio.wait_for(self.wakeup.wait(), remaining)
                except TimeoutError:
                    break
            batch = [self.queue.popleft()]
            size = batch[0].rows.size
            while self.queue and size + self.queue[0].rows.size <= self.max_batch:
                batch.append(self.queue.popleft())
                size += batch[-1].rows.size
            self.queued_rows -= size
            self.metrics.queued.set(self.queued_rows)
            self.metrics.max_batch.set(self.max_batch)
            self.metrics.fill_rows.set(self.fill_rows)
            self.metrics.max_wait.set(self.max_wait_s)
            try:
                scores, seconds = await loop.run_in_executor(self.worker, self._score, [p.rows for p in batch])
            except Exception as error:  # a failing model call fails its requests, not the server
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(error)
                continue
            start = 0
            for p in batch:
                if not p.future.done():  # a client that went away has a cancelled future
                    p.future.set_result((scores[start:start + p.rows.size], seconds))
                start += p.rows.size

    def _score(self, parts: list[EncodedRows]) -> tuple[np.ndarray, float]:
        """One batch (several requests' rows) through the model, in calls of at most the largest batch shape; (the
        scores, the calls' seconds)."""
        if len(parts) == 1:  # one request: its arrays as they are (most calls at low load)
            dense, ids, lengths = parts[0].dense, parts[0].ids, parts[0].lengths
        else:
            dense = np.concatenate([p.dense for p in parts])
            ids = {k: np.concatenate([p.ids[k] for p in parts]) for k in parts[0].ids}
            lengths = {k: np.concatenate([p.lengths[k] for p in parts]) for k in parts[0].lengths}
        cap, out, total = self.options.max_batch, [], 0.0
        for a in range(0, dense.shape[0], cap):
            n = min(cap, dense.shape[0] - a)
            t0 = time.perf_counter()
            out.append(self.model.score_arrays(dense[a:a + n], {k: v[a:a + n] for k, v in ids.items()},
                                               {k: v[a:a + n] for k, v in lengths.items()}, pad_to=self.shape_for(n)))
            seconds = time.perf_counter() - t0
            total += seconds
            self.metrics.forward.observe(seconds)
            self.metrics.batch_rows.observe(n)
            if self.adaptive:
                self.adaptive.record_forward(seconds)
        return np.concatenate(out), total


def _json_error(status: int, message: str, **extra) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


def _unavailable(message: str) -> web.Response:
    """503 with Retry-After: the client should send the request again (to another replica)."""
    response = _json_error(503, message)
    response.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
    return response


GATE = web.AppKey("gate", Gate)
BATCHER = web.AppKey("batcher")  # a function returning the Batcher (made at startup)


def make_app(model: Any, options: ServerOptions | None = None) -> web.Application:
    """The aiohttp application serving `model` (a loader.ServingModel or anything with its encode / score_arrays)."""
    options = options or ServerOptions()
    options.check()
    metrics = Metrics(model, options)
    app = web.Application(client_max_size=options.max_body_bytes)
    state = {"status": "starting"}
    batcher: Batcher | None = None
    gate = Gate(options, metrics)

    @web.middleware
    async def admit(request: web.Request, handler):
        """Every request from its headers to its answer: refused while draining or past the connection cap, cut
        with a 503 past the drain's deadline, counted by path and code (499: its client hung up first)."""
        in_flight = gate.begin()
        gone = False
        try:
            refusal = gate.refusal()
            if refusal is not None:
                response = _unavailable(refusal)
            else:
                try:
                    response = await handler(request)
                except web.HTTPException as error:  # 404 / 405 from the router, as JSON
                    response = _json_error(error.status, error.reason)
                except asyncio.CancelledError:
                    if not in_flight.cut:
                        raise
                    asyncio.current_task().uncancel()  # the drain's deadline: this request is answered, with a 503
                    if isinstance(request.protocol, Connection):  # and the rest of its body is not waited for
                        request.protocol.stop_reading()
                    response = _unavailable(f"the server shut down before answering (--drain_seconds="
                                            f"{options.drain_seconds:g}); send the request again")
                except Exception as error:  # a bug must not take the server down; the client gets a 500
                    response = _json_error(500, f"internal error: {type(error).__name__}")
            if gate.draining:  # no connection outlives its answer during the drain
                response.force_close()
            gone = request.transport is None  # the client hung up (mid-body, or while its rows were scored)
            path = request.path if request.path in ("/v1/score", "/healthz", "/metrics") else "other"
            metrics.requests.labels(path, "499" if gone else str(response.status)).inc()
            return response
        finally:
            gate.end(in_flight, gone)

    app.middlewares.append(admit)

    async def score(request: web.Request) -> web.Response:
        received = time.perf_counter()
        if state["status"] != "ok":
            return _json_error(503, f"the server is {state['status']}")
        try:
            if request.content.is_eof():  # the whole body came with the headers (most requests): no clock to arm
                body = await request.read()
            else:
                async with asyncio.timeout(options.body_timeout_seconds):
                    body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _json_error(413, f"the body is larger than {options.max_body_bytes} bytes (--max_body_bytes); "
                                    "send fewer rows per request")
        except TimeoutError:
            if isinstance(request.protocol, Connection):
                request.protocol.stop_reading()
            response = _json_error(408, "the request's body did not arrive within --body_timeout_seconds="
                                        f"{options.body_timeout_seconds:g}")
            response.force_close()
            return response
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError) as error:
            return _json_error(400, f"the body is not JSON: {error}"[:300])
        if not isinstance(payload, dict) or not isinstance(payload.get("rows"), list):
            return _json_error(400, "the body must be a JSON object {\"rows\": [row, ...]}")
        unknown = sorted(set(payload) - {"rows"})
        if unknown:
            return _json_error(400, f"unknown key {unknown[0]!r}; the body is {{\"rows\": [...]}}")
        rows = payload["rows"]
        if len(rows) > options.max_rows:
            return _json_error(413, f"{len(rows)} rows; at most {options.max_rows} per request (--max_rows)")
        if not rows:
            return _json_error(400, "\"rows\" is empty")
        encoded, errors = model.encode(rows)
        scores: list[float | None] = [None] * len(rows)
        forward = 0.0
        if encoded.size:
            batch_scores, forward = await batcher.submit(encoded)
            for i, p in zip(encoded.index, batch_scores.tolist(), strict=True):
                scores[i] = p
        metrics.rows.inc(encoded.size)
        metrics.row_errors.inc(len(errors))
        seconds = time.perf_counter() - received
        metrics.latency.observe(seconds)
        if batcher.adaptive and batcher.adaptive.record_request(seconds, encoded.size):  # a new window's shares
            for thread, share in zip(("worker", "loop"), batcher.adaptive.busy_shares, strict=True):
                metrics.busy.labels(thread).set(share)
        # Server-Timing (W3C): the server's own time for the request and the model call(s) in it, so a client can
        # tell the server's cost from the network's and its own.
        timing = f"total;dur={1e3 * seconds:.3f}, forward;dur={1e3 * forward:.3f}"
        return web.json_response({"scores": scores, "errors": errors}, status=422 if errors else 200,
                                 headers={"Server-Timing": timing})

    async def healthz(request: web.Request) -> web.Response:
        body = {"status": state["status"]}
        if hasattr(model, "manifest"):
            body.update(model=model.describe(), table_format=model.table_format)
        return web.json_response(body, status=200 if state["status"] == "ok" else 503)

    async def metrics_handler(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": prom.CONTENT_TYPE_LATEST})

    async def lifecycle(app: web.Application):
        nonlocal batcher
        batcher = Batcher(model, options, metrics)
        await asyncio.get_running_loop().run_in_executor(batcher.worker, batcher.warm_up)
        task = asyncio.create_task(batcher.run())
        state["status"] = "ok"
        yield
        task.cancel()
        batcher.worker.shutdown(wait=True)

    def on_drain() -> None:
        state["status"] = "draining"
        if batcher is not None:
            batcher.drain()

    async def on_shutdown(app: web.Application):  # aiohttp's shutdown, when the app runs without `serve`
        on_drain()

    app.router.add_post("/v1/score", score)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics_handler)
    app.cleanup_ctx.append(lifecycle)
    app.on_shutdown.append(on_shutdown)
    gate.on_drain.append(on_drain)
    app[GATE] = gate
    app[BATCHER] = lambda: batcher
    return app


FILES_KEPT = 256  # open files the process keeps for itself beside its connections (libraries, the export's files)


def _room_for_connections(options: ServerOptions, log) -> ServerOptions:
    """`options` with a connection cap the open-file limit (RLIMIT_NOFILE) allows: the soft limit is raised toward
    the hard one as far as the cap needs (past the limit, accept() fails and asyncio stops accepting for a while,
    logging errors); if even the hard limit is too low, the cap is lowered to fit it, and said."""
    try:
        import resource
    except ImportError:  # not POSIX
        return options
    need = options.max_connections + FILES_KEPT
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return options
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else min(need, hard), hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft >= need:
        return options
    cap = max(1, soft - FILES_KEPT)
    log(f"note: the open-file limit ({soft}; ulimit -n) leaves room for {cap} connections, fewer than "
        f"--max_connections={options.max_connections}: serving at most {cap}; raise the limit to serve more")
    return dataclasses.replace(options, max_connections=cap)


def _bind(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address of `host` (not yet listening), as asyncio's create_server binds them; bound
    here, before the model compiles, so a taken port fails at once, and kept so the drain can accept their backlog."""
    try:
        addresses = dict.fromkeys(info[:3] + (info[4],) for info in socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE))
    except socket.gaierror as error:
        raise ConfigError("--host", f"cannot resolve {host!r}: {error.strerror or error}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, address in addresses:
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:  # --port=0: every address on the port the first one got
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock.bind(address)
    except OSError as error:  # the port is taken, the address is not this machine's, ...
        for sock in sockets:
            sock.close()
        raise ConfigError("--port", f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sockets


async def serve(model: Any, host: str, port: int, options: ServerOptions, log=print,
                signalled: Callable[[], bool] = lambda: False) -> DrainReport:
    """Serve until SIGTERM / SIGINT, then drain (connections.py); returns the drain's report. Logs the bound address
    once ready to answer. A signal while the model compiles -- or before, when `signalled()` says one came while the
    caller loaded the model -- stops it before it serves (nothing was accepted)."""
    options.check()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)  # a second signal while draining changes nothing
    if signalled():
        stop.set()
    app = make_app(model, _room_for_connections(options, log))
    gate = app[GATE]
    sockets: list[socket.socket] = []
    # aiohttp's runner runs the application (its startup: the batcher, every batch shape compiled; its cleanup) and
    # makes the request handler; the listening sockets and their connections' protocol are ours (connections.py).
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=CLOSE_GRACE_SECONDS, access_log=None)
    try:
        if stop.is_set():  # while the model loaded
            log("stopped before serving (a signal while the model loaded); bye")
            return gate.report
        sockets = _bind(host, port)
        await runner.setup()
        if stop.is_set():
            await runner.cleanup()
            log("stopped before serving (a signal while the model compiled); bye")
            return gate.report
        protocol = functools.partial(Connection, runner.server, gate, loop=loop,
                                     keepalive_timeout=options.idle_timeout_seconds, access_log=None)
        backlog = min(socket.SOMAXCONN, max(128, gate.options.max_connections))
        listeners = [(await loop.create_server(protocol, sock=sock, backlog=backlog), sock) for sock in sockets]
        sweeper = asyncio.create_task(gate.sweep())
        bound = sockets[0].getsockname()[1]  # the port the OS chose for --port=0
        log(f"serving on http://{host}:{bound} (max_batch {options.max_batch}, max_wait_ms {options.max_wait_ms:g}, "
            f"batch shapes {options.batch_shapes}, scheduler {options.scheduler})")
        await stop.wait()
        await gate.stop_accepting(listeners, protocol)
        log(f"draining: no new connections; answering the {gate.report.in_flight} requests in flight (at most "
            f"--drain_seconds={options.drain_seconds:g})")
        report = await gate.drain()
        await runner.cleanup()  # the idle connections, then the application (the batcher's task and worker)
        await gate.closed_all()
        sweeper.cancel()
    finally:
        for sock in sockets:  # closed already unless serving never began
            sock.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    log(f"{report.describe(options.drain_seconds)}; bye")
    return report
