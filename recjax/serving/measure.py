"""What serving costs, measured: table bytes and test quality per table format, the bare model's forward time per
batch size, and an open-loop load generator against a running server (benchmarks/serving.py and
experiments/notebooks/serving_cost.ipynb use these).

Open loop (the load a population of independent users makes): request i is sent at its scheduled time t_i, with
Poisson inter-arrival gaps at the offered rate, whether or not earlier requests were answered; its latency is counted
from t_i, so a server (or client) falling behind shows as latency instead of silently lowering the offered load (the
"coordinated omission" a closed loop has). Latency-bounded throughput (DeepRecSys, Gupta et al., ISCA 2020): the
highest achieved QPS among the offered rates whose p99 latency meets the target. A burst with SIGTERM in it
(`drain_burst`): what each client of a shutting-down server got. Stalled clients (`stalled_clients`): connections
whose headers promise a body that never comes, and what they cost the other clients meanwhile. The server's CPU
seconds per request (`cpu_per_request`): what handling a request and a connection costs, apart from the wait for
the CPU that a loaded machine adds to every latency.
"""

import asyncio
import collections
import concurrent.futures
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from recjax.batch import pad_batch
from recjax.metrics import auc, logloss
from recjax.serving.tables import FORMATS, decode_table, encode_tables, group_formats, stored_bytes

REPO = pathlib.Path(__file__).resolve().parents[2]


def format_quality(run, formats: Sequence[str] = tuple(FORMATS), split: str = "test") -> list[dict[str, Any]]:
    """Per format: the run's tables' stored bytes and the test AUC / logloss of the model scoring with the rows those
    tables decode to (what ServingStorage's lookup reads), with the change against f32. `run` is a
    recjax.serving.export.TrainedRun."""
    tables = {g: np.asarray(t) for g, t in run.state.tables.items()}
    dims = {g: t.shape[1] for g, t in tables.items()}
    predict = run.predict_step()
    batch_size = int(run.config.train.batch_size)
    batches = list(run.dataset.eval_batches(batch_size, split))
    labels = np.concatenate([b.labels for b in batches])
    out, base = [], None
    for fmt in formats:
        stored, formats = encode_tables(tables, fmt), group_formats(fmt, dims)
        decoded = {g: jax.numpy.asarray(decode_table(s, formats[g], dims[g])) for g, s in stored.items()}
        state = run.state.replace(tables=decoded)
        probs = np.concatenate([np.asarray(predict(state, jax.device_put(pad_batch(b, batch_size))))[:b.size]
                                for b in batches])
        row = {"format": fmt, "table_bytes": stored_bytes(stored), "auc": auc(labels, probs),
               "logloss": logloss(labels, probs)}
        base = base or row
        row.update(bytes_ratio=base["table_bytes"] / row["table_bytes"], auc_delta=row["auc"] - base["auc"],
                   logloss_delta=row["logloss"] - base["logloss"])
        out.append(row)
    return out


def forward_times(model, sizes: Sequence[int], rows: Sequence[Any], repeats: int = 30) -> dict[int, float]:
    """Median seconds of one `model.score_arrays` call per batch size (the export's compiled forward, no server),
    on rows drawn from `rows` (encoded JSON rows); each size compiled before it is timed."""
    encoded, errors = model.encode(list(rows))
    if errors:
        raise ValueError(f"rows with errors: {errors[:3]}")
    out = {}
    for size in sizes:
        take = np.arange(size) % encoded.size
        args = (encoded.dense[take], {k: v[take] for k, v in encoded.ids.items()},
                {k: v[take] for k, v in encoded.lengths.items()})
        model.score_arrays(*args)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.score_arrays(*args)
            times.append(time.perf_counter() - t0)
        out[size] = float(np.median(times))
    return out


class ServerProcess:
    """`python -m experiments.serve --port=0 ...` in a subprocess; `url` once it printed its address."""

    def __init__(self, model_dir: str | pathlib.Path, **options: Any):
        flags = [f"--{k}={v}" for k, v in options.items()]
        self.process = subprocess.Popen([sys.executable, "-m", "experiments.serve", f"--model={model_dir}",
                                         "--port=0", *flags], cwd=REPO, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
        self.output: list[str] = []
        for line in self.process.stdout:  # blocks until the server answers (or has died)
            self.output.append(line)
            if line.startswith("serving on http://"):
                self.url = line.split()[2]
                return
        raise RuntimeError(f"the server exited before serving:\n{''.join(self.output)[-3000:]}")

    def stop(self) -> str:
        if self.process.poll() is None:
            self.process.terminate()
        rest = self.process.stdout.read()
        self.process.wait()
        return "".join(self.output) + rest

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


async def _open_loop(url: str, bodies: Sequence[bytes], rate: float, count: int, seed: int, settle: float
                     ) -> dict[str, Any]:
    """The open loop on raw HTTP/1.1 over keep-alive connections (a free one, else a new one): each request's bytes
    are built once, and an answer is read by its Content-Length, so the generator spends little of the CPU it shares
    with the server (an aiohttp client spent ~3x more per request). Requests scheduled in the first `settle` seconds
    are sent but not counted (the server's scheduler meets the new rate)."""
    host, _, port = url.removeprefix("http://").partition(":")
    requests = [(f"POST /v1/score HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n").encode() + body for body in bodies]
    rng = np.random.default_rng(seed)
    offsets = np.cumsum(rng.exponential(1.0 / rate, count))
    latencies = np.full(count, np.nan)
    codes = np.zeros(count, np.int32)
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    opened: list[asyncio.StreamWriter] = []
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def one(i: int) -> None:
        delay = start + offsets[i] - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        connection = None
        try:
            if idle:
                connection = idle.pop()
            else:
                connection = await asyncio.open_connection(host, int(port))
                opened.append(connection[1])
            reader, writer = connection
            writer.write(requests[i % len(requests)])
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            await reader.readexactly(length)
            codes[i] = int(head[9:12])
            idle.append(connection)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, StopIteration, ValueError):
            codes[i] = -1
            if connection is not None:
                connection[1].close()
        latencies[i] = loop.time() - (start + offsets[i])

    await asyncio.gather(*(one(i) for i in range(count)))
    end = loop.time()
    for writer in opened:
        writer.close()
    counted = offsets >= min(settle, offsets[-1])  # the settle period never takes every request
    ok = (codes == 200) & counted
    lat = latencies[ok] * 1e3
    window = end - (start + offsets[counted][0])
    return {"offered_qps": rate, "requests": int(counted.sum()), "ok": int(ok.sum()),
            "failed": int((counted & (codes != 200)).sum()), "achieved_qps": float(ok.sum() / window),
            "seconds": window, "settle_s": float(offsets[counted][0]), "connections": len(opened),
            "p50_ms": float(np.percentile(lat, 50)) if lat.size else float("nan"),
            "p95_ms": float(np.percentile(lat, 95)) if lat.size else float("nan"),
            "p99_ms": float(np.percentile(lat, 99)) if lat.size else float("nan")}


def open_loop(url: str, rows: Sequence[Any], rate: float, seconds: float, max_requests: int, rows_per_request: int = 1,
              seed: int = 0, settle: float = 0.0) -> dict[str, Any]:
    """Poisson arrivals at `rate` requests/s for `settle` + `seconds` (at most `max_requests` counted), each
    `rows_per_request` rows cycled from `rows`; latency percentiles (ms, from each request's scheduled time) and
    achieved QPS of the requests after the first `settle` seconds."""
    count = max(1, min(max_requests, round(rate * seconds))) + round(rate * settle)
    bodies = [json.dumps({"rows": [rows[(i * rows_per_request + k) % len(rows)] for k in range(rows_per_request)]})
              .encode() for i in range(max(1, len(rows) // rows_per_request))]
    # On a thread of its own: the caller may be inside an event loop already (a Jupyter kernel).
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        return thread.submit(asyncio.run, _open_loop(url, bodies, rate, count, seed, settle)).result()


def server_timing(header: str | None) -> dict[str, float]:
    """{name: milliseconds} of a Server-Timing header ("total;dur=1.2, forward;dur=0.8")."""
    out = {}
    for part in (header or "").split(","):
        name, _, rest = part.strip().partition(";")
        if rest.startswith("dur="):
            out[name] = float(rest[4:])
    return out


async def _closed_loop(url: str, bodies: Sequence[bytes], count: int) -> np.ndarray:
    import aiohttp

    out = np.full((count, 3), np.nan)  # client seconds, the server's total and forward ms
    async with aiohttp.ClientSession() as session:
        loop = asyncio.get_running_loop()
        for i in range(count):
            start = loop.time()
            async with session.post(f"{url}/v1/score", data=bodies[i % len(bodies)],
                                    headers={"Content-Type": "application/json"}) as response:
                await response.read()
                if response.status == 200:
                    timing = server_timing(response.headers.get("Server-Timing"))
                    out[i] = (loop.time() - start, timing.get("total", np.nan), timing.get("forward", np.nan))
    return out


def closed_loop(url: str, rows: Sequence[Any], count: int) -> dict[str, Any]:
    """One client, one request (one row) at a time over one kept-alive connection: the latency of a request that
    never waits for another, i.e. what the server and the HTTP round trip add to the model's forward at batch 1 (the
    low-load end the open loop cannot reach without queueing noise). Percentiles in ms of the answered requests, as
    the client saw them and as the server's Server-Timing header reports them (its own time; its time minus the
    model call's)."""
    bodies = [json.dumps({"rows": [row]}).encode() for row in rows]
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        out = thread.submit(asyncio.run, _closed_loop(url, bodies, count)).result()
    out = out[np.isfinite(out[:, 0])]
    series = {"client": out[:, 0] * 1e3, "server": out[:, 1], "server_minus_forward": out[:, 1] - out[:, 2]}
    record: dict[str, Any] = {"requests": count, "ok": len(out)}
    for name, values in series.items():
        for q in (50, 90, 99):
            record[f"{name}_p{q}_ms"] = float(np.percentile(values, q)) if values.size else float("nan")
    return record


async def _burst(host: str, port: int, payload: bytes, count: int, signal_after: float,
                 process: subprocess.Popen) -> collections.Counter:
    async def one() -> str:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            return "refused"  # the listening socket was closed: the connection was never accepted
        try:
            writer.write(payload)
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            await reader.readexactly(length)
            retry = b"\r\nretry-after:" in head.lower()
            return head[9:12].decode() + (" retry-after" if retry else "")
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, StopIteration):
            return "dropped"  # accepted, then closed or reset without an answer
        finally:
            writer.close()

    clients = [asyncio.ensure_future(one()) for _ in range(count)]
    await asyncio.sleep(signal_after)
    process.send_signal(signal.SIGTERM)
    return collections.Counter(await asyncio.gather(*clients))


def drain_burst(process: "ServerProcess", rows: Sequence[Any], count: int, rows_per_request: int,
                signal_after: float) -> dict[str, Any]:
    """`count` concurrent requests of `rows_per_request` rows (cycled from `rows`, encoded JSON rows), each on its own
    connection, and SIGTERM to the server `signal_after` seconds after they start: how many clients got each answer
    ("200", "503 retry-after", ...), were refused a connection ("refused": never accepted) or lost their accepted
    connection without an answer ("dropped"); the server's exit status and its drain report line. Waits for the
    server to exit."""
    host, _, port = process.url.removeprefix("http://").partition(":")
    body = json.dumps({"rows": [rows[k % len(rows)] for k in range(rows_per_request)]}).encode()
    payload = (f"POST /v1/score HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        outcomes = thread.submit(asyncio.run, _burst(host, int(port), payload, count, signal_after,
                                                     process.process)).result()
    process.process.wait()
    log = process.stop()
    drained = next((line for line in log.splitlines() if line.startswith("drained in")), "")
    return {"requests": count, "rows_per_request": rows_per_request, "body_bytes": len(body),
            "signal_after_s": signal_after, "outcomes": dict(outcomes), "dropped": outcomes["dropped"],
            "exit_status": process.process.returncode, "drain": drained}


async def _stalled(host: str, port: int, count: int, request: bytes, guard_s: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def stall() -> tuple[str, float]:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            return "refused", loop.time() - start
        writer.write(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"rows\": [")
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), guard_s)
            await asyncio.wait_for(reader.read(), guard_s)  # the body, up to the server's close
            return head[9:12].decode(), loop.time() - start
        except TimeoutError:
            return f"no answer in {guard_s:g} s", loop.time() - start
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            return "dropped", loop.time() - start
        finally:
            writer.close()

    stalled = [asyncio.ensure_future(stall()) for _ in range(count)]
    await asyncio.sleep(1.0)  # every stalled connection open
    latencies = []
    while not all(s.done() for s in stalled):  # regular requests, one at a time, until the stalled ones are answered
        t0 = loop.time()
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        await reader.readexactly(length)
        writer.close()
        if head[9:12] == b"200":
            latencies.append(loop.time() - t0)
        await asyncio.sleep(0.05)
    results = await asyncio.gather(*stalled)
    seconds = [t for _, t in results]
    return {"stalled": count, "outcomes": dict(collections.Counter(code for code, _ in results)),
            "answered_after_s": [float(min(seconds)), float(max(seconds))], "regular_requests": len(latencies),
            "regular_p50_ms": float(np.percentile(latencies, 50) * 1e3) if latencies else float("nan"),
            "regular_max_ms": float(max(latencies) * 1e3) if latencies else float("nan")}


def stalled_clients(process: "ServerProcess", rows: Sequence[Any], count: int, guard_s: float = 600.0
                    ) -> dict[str, Any]:
    """`count` connections send headers promising a 100-byte body and 10 bytes of it, then nothing: when each was
    answered and closed (and with what; "no answer in `guard_s` s" for a server that holds them), and the latency of
    regular one-row requests sent one at a time meanwhile (the server serving others while it holds the stalled
    ones)."""
    host, _, port = process.url.removeprefix("http://").partition(":")
    body = json.dumps({"rows": [rows[0]]}).encode()
    request = (f"POST /v1/score HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        return thread.submit(asyncio.run, _stalled(host, int(port), count, request, guard_s)).result()


def _cpu_seconds(pid: int) -> float:
    """A process's user + system CPU seconds (Linux /proc)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _requests(host: str, port: int, request: bytes, count: int, new_connections: bool) -> None:
    connection = None
    for _ in range(count):
        if connection is None or new_connections:
            if connection is not None:
                connection[1].close()
            connection = await asyncio.open_connection(host, port)
        reader, writer = connection
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        await reader.readexactly(length)
    connection[1].close()


def cpu_per_request(process: "ServerProcess", request: bytes, count: int, new_connections: bool) -> float:
    """The server process's CPU microseconds per request over `count` requests sent one at a time (after 200 not
    counted), on one kept-alive connection or a new connection each (Linux: /proc)."""
    host, _, port = process.url.removeprefix("http://").partition(":")
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        thread.submit(asyncio.run, _requests(host, int(port), request, 200, new_connections)).result()
        start = _cpu_seconds(process.process.pid)
        thread.submit(asyncio.run, _requests(host, int(port), request, count, new_connections)).result()
    return (_cpu_seconds(process.process.pid) - start) / count * 1e6


def latency_bounded_throughput(levels: Sequence[dict[str, Any]], target_ms: float) -> float:
    """The highest achieved QPS among load levels with p99 <= target and no failed request (0 if none)."""
    return max([lv["achieved_qps"] for lv in levels if lv["p99_ms"] <= target_ms and lv["failed"] == 0], default=0.0)
