"""The scoring server (python -m experiments.serve) on an ephemeral port: it scores a tiny export exactly as the
loader does, batches concurrent clients without one changing another's scores, answers bad requests with 4xx JSON
naming the row and field (scoring the valid rows), keeps serving, counts it all in /metrics, and drains on SIGTERM.

Readiness and progress are waited for by reading the server's output and polling /metrics, never by sleeping."""

import concurrent.futures
import http.client
import json
import pathlib
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
from test_export import _rows_as_json
from test_train import tiny_config

from recjax.errors import ConfigError
from recjax.serving import loader
from recjax.serving.export import export_run, load_run
from recjax.serving.measure import server_timing
from recjax.serving.server import AdaptiveBatching, ServerOptions
from recjax.train import train_and_evaluate

REPO = pathlib.Path(__file__).resolve().parent.parent
MAX_BATCH = 8


def tiny_export(tmp_path_factory) -> tuple[pathlib.Path, list[dict]]:
    """An int8 export of a tiny synthetic run, and 24 of its test rows as encoded JSON rows."""
    workdir = tmp_path_factory.mktemp("run")
    config = tiny_config(20)
    config.data.bag_sizes = (1, 3, 1, 1, 1, 2)
    config.data.eval_examples = 256
    config.train.eval_every = 20
    train_and_evaluate(config, workdir)
    run = load_run(workdir)
    out = tmp_path_factory.mktemp("export") / "int8"
    export_run(run, out, "int8")
    return out, _rows_as_json(next(run.dataset.eval_batches(24, "test")))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[pathlib.Path, list[dict]]:
    return tiny_export(tmp_path_factory)


class Server:
    """`python -m experiments.serve` on port 0; `url` once it printed its address."""

    def __init__(self, model: pathlib.Path, *flags: str, program: tuple[str, ...] = ("-m", "experiments.serve")):
        self.process = subprocess.Popen(
            [sys.executable, *program, f"--model={model}", "--port=0", f"--max_batch={MAX_BATCH}", *flags], cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output: list[str] = []
        self.terminated = False
        for line in self.process.stdout:  # blocks until the server is ready (or has died)
            self.output.append(line)
            if line.startswith("serving on http://"):
                self.port = int(line.split()[2].rsplit(":", 1)[1])
                break
        else:
            raise AssertionError(f"the server exited before serving:\n{''.join(self.output)[-3000:]}")

    def request(self, method: str, path: str, body: bytes | str | None = None) -> tuple[int, dict | str]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port)
        try:
            connection.request(method, path, body=body, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            text = response.read().decode()
        finally:
            connection.close()
        return response.status, (json.loads(text) if response.getheader("Content-Type", "").startswith(
            "application/json") else text)

    def score(self, rows: list) -> tuple[int, dict]:
        return self.request("POST", "/v1/score", json.dumps({"rows": rows}))

    def metric(self, name: str) -> float:
        _, text = self.request("GET", "/metrics")
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    def terminate(self) -> None:
        """SIGTERM, once: a second one could reach the process after its drain, when asyncio has already removed
        the handlers, and kill it (exit status -15) on its way out."""
        if not self.terminated and self.process.poll() is None:
            self.terminated = True
            self.process.send_signal(signal.SIGTERM)

    def stop(self) -> str:
        self.terminate()
        rest = self.process.stdout.read()
        self.process.stdout.close()
        self.process.wait()
        return "".join(self.output) + rest


def _bits(scores: list[float]) -> np.ndarray:
    return np.asarray(scores, np.float32).view(np.uint32)


def test_server_scores_batches_clients_apart_and_answers_bad_requests(tiny):
    export, rows = tiny
    model = loader.load(export)
    encoded, _ = model.encode(rows)
    oracle = model.score_arrays(encoded.dense, encoded.ids, encoded.lengths, pad_to=None)
    # The server runs every call at MAX_BATCH rows; in-process, that shape scores a row the same whatever its company.
    alone = np.concatenate([model.score_arrays(encoded.dense[i:i + 1], {k: v[i:i + 1] for k, v in encoded.ids.items()},
                                               {k: v[i:i + 1] for k, v in encoded.lengths.items()}, pad_to=MAX_BATCH)
                            for i in range(len(rows))])
    np.testing.assert_allclose(alone, oracle, rtol=1e-5)
    server = Server(export, "--max_wait_ms=5", "--max_rows=16", "--max_body_bytes=20000")
    try:
        status, body = server.request("GET", "/healthz")
        assert status == 200 and body["status"] == "ok" and body["table_format"] == "int8"
        status, body = server.score(rows[:3])
        assert status == 200 and body["errors"] == []
        np.testing.assert_array_equal(_bits(body["scores"]), alone[:3].view(np.uint32))
        # Server-Timing: a lone request waited --max_wait_ms=5 for company, then one model call.
        connection = http.client.HTTPConnection("127.0.0.1", server.port)
        connection.request("POST", "/v1/score", json.dumps({"rows": rows[:3]}), {"Content-Type": "application/json"})
        timing = server_timing(connection.getresponse().getheader("Server-Timing"))
        connection.close()
        assert timing["forward"] > 0 and timing["total"] >= 5.0 + timing["forward"]

        # Mixed requests, many clients at once: each row's score is its score alone, bit for bit.
        bad = {"dense": rows[0]["dense"], "ids": {**rows[0]["ids"], "C3": 1000}}
        requests = [[rows[i], bad, rows[i + 1]] if i % 3 == 0 else [rows[i]] for i in range(0, 22, 2)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(server.score, requests))
        for i, (request, (status, body)) in zip(range(0, 22, 2), zip(requests, answers, strict=True), strict=False):
            if len(request) == 3:
                assert status == 422
                assert body["errors"] == [{"row": 1, "field": "C3", "error": "id 1000 is outside [0, 1000)"}]
                assert body["scores"][1] is None
                np.testing.assert_array_equal(_bits([body["scores"][0], body["scores"][2]]),
                                              alone[[i, i + 1]].view(np.uint32))
            else:
                assert status == 200
                np.testing.assert_array_equal(_bits(body["scores"]), alone[[i]].view(np.uint32))

        # Requests that are wrong as a whole: 4xx JSON, and the server goes on serving.
        assert server.request("POST", "/v1/score", "{not json")[0] == 400
        assert server.request("POST", "/v1/score", "[1, 2]")[0] == 400
        assert server.request("POST", "/v1/score", json.dumps({"rows": []}))[0] == 400
        status, body = server.request("POST", "/v1/score", json.dumps({"rows": rows, "k": 1}))
        assert status == 400 and "unknown key 'k'" in body["error"]
        status, body = server.score(rows[:17])
        assert status == 413 and "at most 16" in body["error"]
        status, body = server.request("POST", "/v1/score", json.dumps({"rows": ["x" * 30000]}))
        assert status == 413 and "--max_body_bytes" in body["error"]
        status, body = server.request("POST", "/v1/score", "[" * 100000)  # past --max_body_bytes before parsing
        assert status == 413
        status, body = server.request("POST", "/v1/score", "[" * 10000)  # deep nesting: not a crash
        assert status == 400
        status, body = server.score([None, 1.5, "a line", {"dense": "x", "ids": rows[0]["ids"]}, {"ids": []}])
        assert status == 422 and [(e["row"], e["field"]) for e in body["errors"]] == [
            (0, "row"), (1, "row"), (2, "row"), (3, "dense"), (4, "ids")] and body["scores"] == [None] * 5
        taken = subprocess.run([sys.executable, "-m", "experiments.serve", f"--model={export}",
                                f"--port={server.port}"], cwd=REPO, capture_output=True, text=True, check=False)
        assert taken.returncode == 2 and f"error: --port: cannot listen on 127.0.0.1:{server.port}" in taken.stderr
        assert server.request("GET", "/nope")[0] == 404
        assert server.request("GET", "/v1/score")[0] == 405
        status, body = server.score(rows[3:6])
        assert status == 200
        np.testing.assert_array_equal(_bits(body["scores"]), alone[3:6].view(np.uint32))

        # /metrics counts what happened: rows scored, rows refused, requests by code.
        scored = 3 + 3 + sum(len(r) - (len(r) == 3) for r in requests) + 3  # the Server-Timing request's 3 too
        assert server.metric("recjax_serving_rows_scored_total") == scored
        assert server.metric("recjax_serving_row_errors_total") == 4 + 5
        assert server.metric('recjax_serving_requests_total{code="413"') == 3
        scoring = 2 + len(requests) + 1 + 1  # the requests that reached the batcher, 422s included
        assert server.metric("recjax_serving_request_latency_seconds_count") == scoring
        assert server.metric("recjax_serving_batch_rows_sum") == scored
    finally:
        log = server.stop()
    assert server.process.returncode == 0, log[-3000:]
    assert "0 of the 0 requests in flight answered; 0 requests arriving during the drain refused" in log
    assert log.rstrip().endswith("; bye") and "Traceback" not in log


def test_server_with_tables_on_disk_reports_the_cache_hit_rate(tiny):
    """--tier=disk: the scores are the in-RAM model's, bit for bit, and /metrics reports the RAM cache's hit rate,
    that of the same calls (the warm-up's, then each request's batch) made in this process."""
    from recjax.serving.tiered import TieredServingModel

    export, rows = tiny
    in_ram = loader.load(export)
    replica = TieredServingModel(export, cache=0.1)
    spec = replica.features
    replica.score_arrays(np.zeros((1, replica.num_dense), np.float32),  # the server's warm-up call
                         {f["name"]: np.zeros((1, f["bag_size"]), np.int32) for f in spec},
                         {f["name"]: np.zeros(1, np.int32) for f in spec}, pad_to=MAX_BATCH)
    server = Server(export, "--tier=disk", "--cache=0.1", "--max_wait_ms=0")
    try:
        for start in range(0, 24, 6):  # one request at a time: each is one batch
            status, body = server.score(rows[start:start + 6])
            assert status == 200 and body["errors"] == []
            encoded, _ = in_ram.encode(rows[start:start + 6])
            expected = in_ram.score_arrays(encoded.dense, encoded.ids, encoded.lengths, pad_to=MAX_BATCH)
            np.testing.assert_array_equal(_bits(body["scores"]), expected.view(np.uint32))
            replica.score_arrays(encoded.dense, encoded.ids, encoded.lengths, pad_to=MAX_BATCH)
        hits, lookups = replica.cache_stats()
        assert 0 < hits < lookups
        assert server.metric("recjax_serving_table_cache_hit_ratio") == pytest.approx(hits / lookups, rel=1e-12)
    finally:
        log = server.stop()
    assert "row cache" in log and server.process.returncode == 0, log[-3000:]


def test_sigterm_drains_the_queued_request(tiny):
    """A request queued behind a long max_wait_ms is scored and answered after SIGTERM, then the server exits 0."""
    export, rows = tiny
    model = loader.load(export)
    server = Server(export, "--max_wait_ms=600000")
    answer: list = []
    try:
        client = threading.Thread(target=lambda: answer.append(server.score(rows[:2])))
        client.start()
        while server.metric("recjax_serving_queued_rows") < 2:  # the request waits in the batcher's queue
            pass
        server.terminate()
        client.join()
    finally:
        log = server.stop()
    assert server.process.returncode == 0, log[-3000:]
    status, body = answer[0]
    assert status == 200
    encoded, _ = model.encode(rows[:2])
    np.testing.assert_array_equal(_bits(body["scores"]), model.score_arrays(
        encoded.dense, encoded.ids, encoded.lengths, pad_to=MAX_BATCH).view(np.uint32))
    assert log.index("draining: no new connections; answering the 1 requests in flight") < log.index(
        "drained in ") < log.index("1 of the 1 requests in flight answered")


def test_adaptive_batching_decisions():
    """The scheduler's choices, computed by hand: calls take up to the largest batch whose warm-up call fit target / 4
    (the cap when none did); its wait climbs a ladder of 0, 0.5, 1, 2, 4 ms (a 20 ms target): none while the rate
    times the top rung is under one row, one rung up a window on a tail under half the target or over the target,
    held in between; a window closes after `window` requests or after `period_s` with `min_requests`, and measures
    the worker's share (call seconds) and the event loop's (its thread's CPU seconds), for /metrics."""
    shapes = {n: n for n in (1, 2, 4, 8, 16, 32, 64)}
    call_s = {1: 0.001, 2: 0.0011, 4: 0.0012, 8: 0.0014, 16: 0.002, 32: 0.003, 64: 0.006}
    adaptive = AdaptiveBatching(shapes, target_ms=20.0, call_s=call_s, window=4, period_s=0.5, min_requests=2)
    state = lambda: (adaptive.fill_rows, adaptive.max_batch, adaptive.max_wait_ms)  # noqa: E731
    assert state() == (1, 32, 0.0)  # 64's call, 6 ms, is over 20 / 4
    adaptive.decide(p99_ms=25.0, rows_per_s=200.0)  # 200/s x 4 ms = 0.8 rows: waiting gathers nothing, even over
    assert state() == (1, 32, 0.0)
    waits = []
    for p99 in (8.0, 8.0, 15.0, 15.0, 25.0):  # 300/s x 4 ms = 1.2 rows: up on room, held between, up over the target
        adaptive.decide(p99_ms=p99, rows_per_s=300.0)
        waits.append(adaptive.max_wait_ms)
    assert waits == [0.5, 1.0, 1.0, 1.0, 2.0] and state() == (32, 32, 2.0)  # waiting: for up to the cap
    for p99 in (30.0, 40.0, 12.0):  # to the top rung and no further; held there between half and the target
        adaptive.decide(p99_ms=p99, rows_per_s=800.0)
    assert state() == (32, 32, 4.0)
    adaptive.decide(p99_ms=5.0, rows_per_s=240.0)  # the load fell: 240/s x 4 ms < 1 row: no wait
    assert state() == (1, 32, 0.0)
    adaptive.record_forward(0.004)  # two calls: the worker busy 34 ms
    adaptive.record_forward(0.030)
    assert adaptive.max_batch == 32  # slower calls under load leave the cap as the warm-up set it
    start = adaptive.window_start
    closed = [adaptive.record_request(seconds, 1, now=start + 0.1, loop_cpu=10.0 + 0.01 * k)  # 4 one-row requests
              for k, seconds in enumerate((0.001, 0.002, 0.003, 0.1))]  # in 0.1 s close a window
    assert closed == [False, False, False, True]
    p99 = 1e3 * np.percentile([0.001, 0.002, 0.003, 0.1], 99)  # busy 34 ms of 100; 40/s: no wait; the loop's thread
    assert adaptive.decisions[-1] == (pytest.approx(p99), pytest.approx(40.0), pytest.approx(0.34),  # on the CPU 30 ms
                                      pytest.approx(0.3), 1, 32, 0.0)  # (from the first request's reading)
    assert adaptive.busy_shares == (pytest.approx(0.34), pytest.approx(0.3))
    assert adaptive.latencies == [] and adaptive.rows == 0 and adaptive.busy_s == 0.0
    adaptive.record_request(0.001, 3, now=start + 0.3, loop_cpu=10.05)  # 0.2 s into the window, 1 request: open
    adaptive.record_request(0.001, 3, now=start + 0.5, loop_cpu=10.07)  # 0.4 s: open
    assert len(adaptive.latencies) == 2
    adaptive.record_request(0.001, 3, now=start + 0.7, loop_cpu=10.09)  # 0.6 s >= period, 3 >= min_requests: closes
    assert adaptive.decisions[-1] == (pytest.approx(1.0), pytest.approx(9 / 0.6), 0.0, pytest.approx(0.06 / 0.6),
                                      1, 32, 0.0)
    slow = AdaptiveBatching(shapes, target_ms=20.0, call_s={n: 0.008 for n in shapes})
    assert slow.max_batch == 64  # no warm-up call fit 20 / 4 ms: the cap


def test_server_options_are_checked():
    with pytest.raises(ConfigError, match="--max_batch: must be >= 1, got 0"):
        ServerOptions(max_batch=0).check()
    with pytest.raises(ConfigError, match="--scheduler: must be one of"):
        ServerOptions(scheduler="magic").check()
    result = subprocess.run([sys.executable, "-m", "experiments.serve", "--model=/nonexistent"], cwd=REPO,
                            capture_output=True, text=True, check=False)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith(
        "error: --model=/nonexistent: cannot load the export: /nonexistent is not a recjax export")


@pytest.mark.slow  # trains, exports and serves under load
def test_serving_cost_notebook_runs(tmp_path, monkeypatch):
    """experiments/notebooks/serving_cost.ipynb top to bottom in its tiny setting: the format table, the load curves
    and both plots."""
    from conftest import run_notebook

    notebook = run_notebook(REPO / "experiments" / "notebooks" / "serving_cost.ipynb", tmp_path, monkeypatch)
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 2, "a plot is missing"
    text = "".join(o.get("text", "") for o in outputs)
    assert "int4" in text and "latency-bounded QPS at p99 <= 20 ms" in text and "server overhead" in text
