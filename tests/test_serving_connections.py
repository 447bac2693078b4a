"""The scoring server's connections (recjax/serving/connections.py), driven by raw-socket clients that send what an
HTTP library would not (half a body, headers that never end, nothing at all): SIGTERM answers every request in
flight -- bodies still arriving too -- and refuses later ones with 503 + Retry-After, never dropping a connection,
and says in its exit status whether all were answered; slow clients get 408 and are cut off, idle kept-alive
connections close, connections past the cap are refused at once, and a client that hangs up counts as 499.

Nothing is timed: the servers' limits are short, and the tests wait for outcomes (an answer, a closed connection, a
/metrics count), each wait bounded by GUARD_S only to end a real hang."""

import asyncio
import collections
import json
import signal
import subprocess
import sys

import numpy as np
import pytest
from test_serving_server import MAX_BATCH, REPO, Server, tiny_export

from recjax.errors import ConfigError
from recjax.serving import loader
from recjax.serving.server import ServerOptions

GUARD_S = 600.0  # ends a wait on the server that hangs (each takes well under a second on an idle machine)
ROWS_PER_REQUEST = 240  # ~75 KB of JSON: a body arrives in several reads
# Limits no loaded machine reaches, where a test's outcome must not depend on the time things take.
PATIENT = ("--drain_seconds=3600", "--header_timeout_seconds=3600", "--body_timeout_seconds=3600")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_export(tmp_path_factory)


def _request(body: bytes, path: str = "/v1/score") -> tuple[bytes, bytes]:
    head = (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
            "\r\n\r\n").encode()
    return head, body


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), GUARD_S)


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """(status, headers with lower-case names, body) of one HTTP/1.1 answer read by its Content-Length."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), GUARD_S)
    lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if line)}
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), GUARD_S)
    return int(lines[0].split()[1]), headers, body


async def _closed(reader: asyncio.StreamReader) -> bool:
    """The server closed the connection (EOF), after whatever it sent."""
    return await asyncio.wait_for(reader.read(), GUARD_S) == b""


async def _metric(port: int, name: str) -> float:
    """A /metrics value, read on a new connection: again, while the server is at its connection cap (a connection
    the test closed is not yet closed on the server's side)."""
    while True:
        reader, writer = await _connect(port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n")
        status, _, body = await _answer(reader)
        writer.close()
        if status != 503 or b"too many open connections" not in body:
            break
        await asyncio.sleep(0.02)
    assert status == 200, body
    return sum(float(line.split()[-1]) for line in body.decode().splitlines() if line.startswith(name))


async def _until(condition, what: str) -> None:
    """Poll an async condition (every 20 ms) until it holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + GUARD_S
    while not await condition():
        assert loop.time() < deadline, f"waited {GUARD_S:g} s for {what}"
        await asyncio.sleep(0.02)


async def _line(server: Server, starting: str) -> str:
    """The server's next output line starting with `starting` (earlier ones are kept in server.output)."""
    loop = asyncio.get_running_loop()
    while True:
        line = await asyncio.wait_for(loop.run_in_executor(None, server.process.stdout.readline), GUARD_S)
        assert line, f"the server exited before printing {starting!r}:\n{''.join(server.output)[-3000:]}"
        server.output.append(line)
        if line.startswith(starting):
            return line


def _oracle(export, rows: list) -> np.ndarray:
    """The rows' scores as the server computes them: in calls of MAX_BATCH rows at that shape."""
    model = loader.load(export)
    encoded, errors = model.encode(rows)
    assert not errors
    return np.concatenate([model.score_arrays(encoded.dense[a:a + MAX_BATCH],
                                              {k: v[a:a + MAX_BATCH] for k, v in encoded.ids.items()},
                                              {k: v[a:a + MAX_BATCH] for k, v in encoded.lengths.items()},
                                              pad_to=MAX_BATCH) for a in range(0, len(rows), MAX_BATCH)])


def _large(rows: list) -> list:
    return [rows[i % len(rows)] for i in range(ROWS_PER_REQUEST)]


def _scores_bits(body: bytes) -> np.ndarray:
    return np.asarray(json.loads(body)["scores"], np.float32).view(np.uint32)


def test_sigterm_answers_requests_whose_bodies_are_still_arriving(tiny):
    """64 large requests send their headers and half their body; SIGTERM; then the rest of each body: every one is
    answered 200 with its scores, bit for bit. Meanwhile a request on an idle kept-alive connection gets 503 +
    Retry-After and a new connection is refused; the server exits 0 and says what it answered and refused."""
    export, rows = tiny
    request_rows = _large(rows)
    expected = _oracle(export, request_rows).view(np.uint32)
    head, body = _request(json.dumps({"rows": request_rows}).encode())
    count = 64
    server = Server(export, "--max_wait_ms=1", *PATIENT)

    async def run() -> list:
        kept = await _connect(server.port)  # answered once, then idle and kept alive
        kept[1].write(b"".join(_request(json.dumps({"rows": rows[:2]}).encode())))
        assert (await _answer(kept[0]))[0] == 200
        clients = [await _connect(server.port) for _ in range(count)]
        for _, writer in clients:
            writer.write(head + body[:len(body) // 2])
        await _until(lambda: _in_flight(server.port, count), f"{count} requests in flight")
        server.terminate()
        await _line(server, "draining")
        kept[1].write(b"".join(_request(json.dumps({"rows": rows[:2]}).encode())))
        status, headers, refusal = await _answer(kept[0])
        assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close", refusal
        assert "shutting down" in json.loads(refusal)["error"] and await _closed(kept[0])
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", server.port)
        for _, writer in clients:
            writer.write(body[len(body) // 2:])
        return await asyncio.gather(*(_answer(reader) for reader, _ in clients))

    try:
        answers = asyncio.run(run())
    finally:
        log = server.stop()
    for status, headers, answer in answers:
        assert status == 200 and headers["connection"] == "close", answer[:300]
        np.testing.assert_array_equal(_scores_bits(answer), expected)
    assert server.process.returncode == 0, log[-3000:]
    assert (f"{count} of the {count} requests in flight answered; 1 requests arriving during the drain refused "
            "(503 + Retry-After); bye") in log and "Traceback" not in log


async def _in_flight(port: int, count: int) -> bool:
    return await _metric(port, "recjax_serving_requests_in_flight") >= count


def test_a_request_not_answered_within_drain_seconds_gets_503_and_a_failing_exit_status(tiny):
    """Requests whose bodies never finish, SIGTERM with --drain_seconds=1: each gets 503 + Retry-After when the
    drain's time is up (not a dropped connection), and the exit status says they were not answered."""
    export, rows = tiny
    head, body = _request(json.dumps({"rows": _large(rows)}).encode())
    count = 16
    server = Server(export, "--drain_seconds=1", "--body_timeout_seconds=3600")

    async def run() -> list:
        clients = [await _connect(server.port) for _ in range(count)]
        for _, writer in clients:
            writer.write(head + body[:len(body) // 2])
        await _until(lambda: _in_flight(server.port, count), f"{count} requests in flight")
        server.terminate()
        return await asyncio.gather(*(_answer(reader) for reader, _ in clients))

    try:
        answers = asyncio.run(run())
    finally:
        log = server.stop()
    for status, headers, answer in answers:
        assert status == 503 and headers["retry-after"] == "1", answer
        assert "--drain_seconds=1" in json.loads(answer)["error"]
    assert server.process.returncode == 1, log[-3000:]
    assert f"0 of the {count} requests in flight answered, {count} unanswered within --drain_seconds=1" in log
    assert "Traceback" not in log


ANSWERED_BEFORE = {"first_read": 0, "first_answer": 1, "half_answered": 100, "last_answers": 195}  # of 200


@pytest.mark.slow  # four servers under a burst of large requests
@pytest.mark.parametrize("moment", ["first_read", "first_answer", "half_answered", "last_answers"])
def test_sigterm_during_a_burst_answers_every_accepted_request(tiny, moment):
    """200 concurrent requests of 240 rows, SIGTERM at several moments -- once the server has read a request's
    headers (before any answer), after the first answer, with half answered, with a few left -- and 50 more sent
    right after the signal. Every client whose connection was accepted gets 200 (with its scores) or 503 +
    Retry-After, never a reset or a closed connection without an answer; a client that connects after the listening
    socket closed is refused. The server exits 0 and counts the same answers and refusals."""
    export, rows = tiny
    request_rows = _large(rows)
    expected = _oracle(export, request_rows).view(np.uint32)
    payload = b"".join(_request(json.dumps({"rows": request_rows}).encode()))
    count = 200
    server = Server(export, "--max_wait_ms=1", *PATIENT)
    answered = []

    async def client(k: int) -> str:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        except ConnectionRefusedError:
            return "refused"
        writer.write(payload)
        try:
            status, headers, answer = await _answer(reader)
        except (ConnectionError, asyncio.IncompleteReadError) as error:
            return f"dropped: {type(error).__name__}"
        finally:
            writer.close()
        answered.append(k)
        if status == 200:
            np.testing.assert_array_equal(_scores_bits(answer), expected)
            return "200"
        return f"{status} retry-after {headers.get('retry-after')}"

    async def run() -> collections.Counter:
        clients = [asyncio.create_task(client(k)) for k in range(count)]
        if moment == "first_read":
            await _until(lambda: _in_flight(server.port, 1), "a request in flight")
        while len(answered) < ANSWERED_BEFORE[moment]:
            await asyncio.sleep(0.001)
        server.terminate()
        clients += [asyncio.create_task(client(count + k)) for k in range(50)]
        return collections.Counter(await asyncio.gather(*clients))

    try:
        outcomes = asyncio.run(run())
    finally:
        log = server.stop()
    assert set(outcomes) <= {"200", "503 retry-after 1", "refused"}, outcomes
    assert outcomes["200"] >= ANSWERED_BEFORE[moment]
    assert server.process.returncode == 0, log[-3000:]
    drained = next(line for line in log.splitlines() if line.startswith("drained in"))
    in_flight = int(drained.split(" requests in flight")[0].rsplit(" ", 1)[1])
    assert drained.split(": ", 1)[1].startswith(f"{in_flight} of the {in_flight} requests in flight answered")
    assert f"; {outcomes['503 retry-after 1']} requests arriving during the drain refused" in drained
    assert "Traceback" not in log


def test_slow_clients_get_408_and_idle_connections_close(tiny):
    """Short limits: a connection that sends nothing and one that stops mid-headers get 408 and are closed; 100
    connections whose headers promise a body that never comes each get 408 and are closed (the server's open
    connections fall back); a kept-alive connection left idle is closed; and the server answers others meanwhile."""
    export, rows = tiny
    server = Server(export, "--header_timeout_seconds=2", "--body_timeout_seconds=2", "--idle_timeout_seconds=4")
    score = b"".join(_request(json.dumps({"rows": rows[:2]}).encode()))

    async def run() -> None:
        silent = await _connect(server.port)
        halfway = await _connect(server.port)
        halfway[1].write(b"POST /v1/score HTTP/1.1\r\nHost: test\r\nContent-Len")
        stalled = []
        for _ in range(100):  # headers sent as each connects (each connection's header timeout starts then)
            stalled.append(await _connect(server.port))
            stalled[-1][1].write(b"POST /v1/score HTTP/1.1\r\nHost: test\r\nContent-Length: 100\r\n\r\n{\"rows\": [")
        kept = await _connect(server.port)
        kept[1].write(score)
        assert (await _answer(kept[0]))[0] == 200
        for reader, _ in (silent, halfway):
            status, headers, body = await _answer(reader)
            assert status == 408 and headers["connection"] == "close"
            assert "--header_timeout_seconds=2" in json.loads(body)["error"] and await _closed(reader)
        for reader, _ in stalled:
            status, headers, body = await _answer(reader)
            assert status == 408 and headers["connection"] == "close"
            assert "--body_timeout_seconds=2" in json.loads(body)["error"] and await _closed(reader)
        assert await _closed(kept[0])  # idle for --idle_timeout_seconds after its answer
        fresh = await _connect(server.port)
        fresh[1].write(score)
        assert (await _answer(fresh[0]))[0] == 200
        assert await _metric(server.port, 'recjax_serving_requests_total{code="408",path="/v1/score"}') == 100
        assert await _metric(server.port, 'recjax_serving_requests_total{code="408",path="other"}') == 2
        await _until(lambda: _open_connections_at_most(server.port, 2), "the cut connections to close")

    try:
        asyncio.run(run())
    finally:
        log = server.stop()
    assert server.process.returncode == 0 and "Traceback" not in log, log[-3000:]


async def _open_connections_at_most(port: int, count: int) -> bool:
    return await _metric(port, "recjax_serving_open_connections") <= count  # /metrics' own connection included


def test_connection_cap_refuses_at_once_and_a_vanishing_client_counts_499(tiny):
    """A cap of 3 connections (the open-file limit lowers the default cap to it, and says so): a fourth connection
    is answered 503 + Retry-After at once while three sit open; once one closes, a new connection is served. A client
    that hangs up mid-body is counted under code 499, not as a server error."""
    from recjax.serving.server import FILES_KEPT

    export, rows = tiny
    limit = FILES_KEPT + 3
    limited = (f"import resource, runpy\nresource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit}))\n"
               "runpy.run_module('experiments.serve', run_name='__main__')")  # `ulimit -n`, without a fork
    server = Server(export, program=("-c", limited))
    assert (f"note: the open-file limit ({limit}; ulimit -n) leaves room for 3 connections, fewer than "
            "--max_connections=4096: serving at most 3") in "".join(server.output)
    score = b"".join(_request(json.dumps({"rows": rows[:2]}).encode()))

    async def run() -> None:
        held = [await _connect(server.port) for _ in range(3)]
        extra = await _connect(server.port)
        extra[1].write(score)
        status, headers, body = await _answer(extra[0])
        assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close"
        assert "--max_connections=3" in json.loads(body)["error"] and await _closed(extra[0])
        held[0][1].write(score)  # the held connections are served
        assert (await _answer(held[0][0]))[0] == 200
        for _, writer in held[1:]:
            writer.close()

        async def served() -> bool:
            reader, writer = await _connect(server.port)
            writer.write(score)
            status = (await _answer(reader))[0]
            writer.close()
            return status == 200

        await _until(served, "a connection under the cap")
        assert await _metric(server.port, 'recjax_serving_requests_total{code="503",path="other"}') >= 1
        vanishing = await _connect(server.port)
        vanishing[1].write(b"POST /v1/score HTTP/1.1\r\nHost: test\r\nContent-Length: 1000\r\n\r\n{\"rows\": [")
        await _until(lambda: _in_flight(server.port, 1), "the vanishing client's request in flight")
        vanishing[1].close()
        await _until(lambda: _counted(server.port, "499"), "the hung-up request counted")
        held[0][1].close()
        assert await _metric(server.port, 'recjax_serving_requests_total{code="500"') == 0

    try:
        asyncio.run(run())
    finally:
        log = server.stop()
    assert server.process.returncode == 0 and "Traceback" not in log, log[-3000:]


async def _counted(port: int, code: str) -> bool:
    return await _metric(port, f'recjax_serving_requests_total{{code="{code}",path="/v1/score"}}') == 1


def test_sigterm_while_the_model_compiles_stops_cleanly(tiny):
    """SIGTERM once the model is loaded, while its batch shapes compile (or just after): exit 0, no traceback."""
    export, _ = tiny
    process = subprocess.Popen([sys.executable, "-m", "experiments.serve", f"--model={export}", "--port=0",
                                "--batch_shapes=pow2", "--max_batch=256"], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    output = [process.stdout.readline()]
    assert output[0].startswith("model: "), output
    process.send_signal(signal.SIGTERM)
    output += process.stdout.readlines()
    process.stdout.close()
    assert process.wait() == 0 and "Traceback" not in "".join(output), output
    assert output[-1].rstrip().endswith("bye"), output


def test_serve_without_the_serve_extra_names_the_install_command():
    """aiohttp made unimportable: one error line naming pip install -e ".[serve]", exit status 2, no traceback."""
    blocked = ("import runpy, sys\nsys.modules['aiohttp'] = None\n"
               "sys.argv = ['experiments.serve', '--model=/nonexistent']\n"
               "runpy.run_module('experiments.serve', run_name='__main__')\n")
    result = subprocess.run([sys.executable, "-c", blocked], cwd=REPO, capture_output=True, text=True, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        'error: the server needs the serve extra, and aiohttp is not installed: pip install -e ".[serve]" (from the '
        "repository root)"]


def test_connection_options_are_checked():
    with pytest.raises(ConfigError, match="--header_timeout_seconds: must be a finite number > 0, got 0"):
        ServerOptions(header_timeout_seconds=0).check()
    with pytest.raises(ConfigError, match="--max_connections: must be >= 1, got 0"):
        ServerOptions(max_connections=0).check()
    with pytest.raises(ConfigError, match="--body_timeout_seconds: must be a finite number > 0, got inf"):
        ServerOptions(body_timeout_seconds=float("inf")).check()

