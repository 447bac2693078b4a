r"""Serve an export (python -m experiments.export) over HTTP with dynamic batching and Prometheus metrics.

    python -m experiments.serve --model=runs/ml100k/export --port=8500
    curl -s localhost:8500/v1/score -d '{"rows": ["196\t242", "186\t302"]}'
    curl -s localhost:8500/metrics
    python -m experiments.serve --model=runs/ml100k/export_int8 --tier=disk --cache=0.1   # tables left on disk

The endpoints, the batching and the scheduler are described in recjax/serving/server.py, the per-connection limits
and the drain in recjax/serving/connections.py. --port=0 binds a free port and prints it ("serving on
http://HOST:PORT ..."). SIGTERM / Ctrl-C drain: the requests in flight are answered, those arriving meanwhile get
503 + Retry-After; the exit status is 0 when every request in flight got its answer within --drain_seconds, 1 when
some got a 503 instead. Needs the serve extra: pip install -e ".[serve]".
"""

import signal
import sys

from absl import flags

from recjax import cli

EXTRA_MODULES = ("aiohttp", "prometheus_client")  # what the serve extra installs (setup.py)
EXIT_UNANSWERED = 1  # the drain answered some requests in flight 503: they were not scored within --drain_seconds

_MODEL = flags.DEFINE_string("model", None, "The export directory (python -m experiments.export --out).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to bind (0.0.0.0 for every interface).")
_PORT = flags.DEFINE_integer("port", 8500, "Port to bind (0: any free port, printed once ready).")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 64, "Rows per model call at most (the compiled batch shape).")
_MAX_WAIT_MS = flags.DEFINE_float("max_wait_ms", 2.0, "How long the oldest queued request waits for more rows.")
_MAX_ROWS = flags.DEFINE_integer("max_rows", 1024, "Rows per request at most (more: 413).")
_MAX_BODY = flags.DEFINE_integer("max_body_bytes", 4 << 20, "Request body bytes at most (more: 413).")
_BATCH_SHAPES = flags.DEFINE_string("batch_shapes", "fixed", "fixed: every call at max_batch rows (a row's score "
                                    "never depends on its batch); pow2: padded to the next power of two.")
_SCHEDULER = flags.DEFINE_string("scheduler", "fixed", "fixed, or adaptive: max_batch from the warm-up's call "
                                 "times, max_wait_ms online against --p99_target_ms (DeepRecSys-style).")
_P99 = flags.DEFINE_float("p99_target_ms", 20.0, "The adaptive scheduler's p99 latency target.")
_DRAIN = flags.DEFINE_float("drain_seconds", 30.0, "On SIGTERM, wait at most this long for requests in flight.")
_HEADER_TIMEOUT = flags.DEFINE_float("header_timeout_seconds", 10.0, "A request's headers must arrive within this "
                                     "many seconds of its connection opening (or of its first byte): else 408.")
_BODY_TIMEOUT = flags.DEFINE_float("body_timeout_seconds", 30.0, "A request's body must arrive within this many "
                                   "seconds of its headers: else 408.")
_IDLE_TIMEOUT = flags.DEFINE_float("idle_timeout_seconds", 75.0, "A kept-alive connection without a request this "
                                   "long is closed.")
_MAX_CONNECTIONS = flags.DEFINE_integer("max_connections", 4096, "Open connections at most: a connection past it "
                                        "is answered 503 + Retry-After at once (lowered, with a note, where the "
                                        "open-file limit allows fewer).")
_TIER = flags.DEFINE_string("tier", "memory", "Where the tables are: memory (all in RAM), or disk (left in the "
                            "export's files behind a RAM row cache; recjax/serving/tiered.py).")
_CACHE = flags.DEFINE_float("cache", 0.1, "--tier=disk: the share of each table's rows the RAM cache holds, (0, 1].")
_CACHE_POLICY = flags.DEFINE_string("cache_policy", "lru", "--tier=disk: the cache's eviction, lru or lfu.")


def main(argv):
    if len(argv) > 1:
        cli.fail(f"unexpected arguments: {argv[1:]}")
    if not _MODEL.value:
        cli.fail("--model is required: an export directory (python -m experiments.export --out=DIR)")
    # SIGTERM while the model loads: noted, and the server stops before it serves (exit 0) instead of dying.
    terminated: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: terminated.append(signum))
    import asyncio

    try:
        from recjax.serving.server import ServerOptions, serve
    except ModuleNotFoundError as error:  # the serve extra is not installed
        if (error.name or "").split(".")[0] not in EXTRA_MODULES:
            raise
        cli.fail(f"the server needs the serve extra, and {error.name} is not installed: pip install -e \".[serve]\" "
                 "(from the repository root)")
    from recjax.serving.loader import ServingModel
    from recjax.serving.tiered import TIERS, TieredServingModel

    options = ServerOptions(max_batch=_MAX_BATCH.value, max_wait_ms=_MAX_WAIT_MS.value, max_rows=_MAX_ROWS.value,
                            max_body_bytes=_MAX_BODY.value, batch_shapes=_BATCH_SHAPES.value,
                            scheduler=_SCHEDULER.value, p99_target_ms=_P99.value, drain_seconds=_DRAIN.value,
                            header_timeout_seconds=_HEADER_TIMEOUT.value, body_timeout_seconds=_BODY_TIMEOUT.value,
                            idle_timeout_seconds=_IDLE_TIMEOUT.value, max_connections=_MAX_CONNECTIONS.value)
    options.check()
    if _TIER.value not in TIERS:
        cli.fail(f"--tier={_TIER.value}: use one of {list(TIERS)}")
    try:  # the loader imports no recjax (an export is read with jax + numpy only), so its errors are plain ones
        if _TIER.value == "disk":
            model = TieredServingModel(_MODEL.value, _CACHE.value, _CACHE_POLICY.value)
        else:
            model = ServingModel(_MODEL.value)
    except (OSError, ValueError, KeyError) as error:
        cli.fail(f"--model={_MODEL.value}: cannot load the export: {error}")
    print(f"model: {model.describe()}", flush=True)
    report = asyncio.run(serve(model, _HOST.value, _PORT.value, options, log=lambda m: print(m, flush=True),
                               signalled=lambda: bool(terminated)))
    if not report.complete:
        sys.exit(EXIT_UNANSWERED)


if __name__ == "__main__":
    cli.run(main)
