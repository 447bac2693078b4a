r"""The disk tier (recjax/tiering): storage engines, the disk's floor, the cache against memory, the MLPerf tables.

    python benchmarks/tiering.py --out /tmp/tiering.jsonl                 # every section, in this order
    python benchmarks/tiering.py --only engines,floor --dir /tmp/t        # one or more sections
    python benchmarks/tiering.py --only plot --out /tmp/tiering.jsonl     # the PNG from an earlier run's lines
    python benchmarks/tiering.py --only mesh --out /tmp/mesh.jsonl        # the disk tier on 8 CPU devices

One JSON line per measurement to stdout (and appended to --out), progress to stderr. Table files go under --dir (a
fresh temporary directory by default), removed at the end. Sections:

  engines   random reads / writes of 260-byte records (dim 64 + a row-wise accumulator) in batches of 8192 distinct
            rows of a 1M-row table, per candidate engine: the file mapped + numpy gathers on a 16-thread pool (main's
            until session 17: SIGBUS on a truncated file), the same mapping copied through by the kernel
            (process_vm_readv / writev, 1,024 rows a call: a short count instead of SIGBUS), the store itself
            (recjax/tiering/store.py: pread / pwrite a row per call from its 16-thread pool), LMDB, RocksDB
            (rocksdict), tensorstore (zarr3, 256-row chunks); warm (page cache holding the file) and, where the engine
            reads a plain file, cold (its pages dropped with posix_fadvise DONTNEED; a mapping's own pages with
            MADV_DONTNEED first); for the mappings, what their first batch added to the process's RssFile. The two
            key-value stores and tensorstore keep their own files, so only their warm numbers are comparable. Then
            the store's write-back of a tenth of the rows on cold pages: by spans (sorted) and a write per row.
  floor     the disk itself: random 4 KiB reads/s one at a time and 16 in flight, sequential read MB/s, with the page
            cache dropped (posix_fadvise DONTNEED; whether O_DIRECT opens is reported too).
  kaggle    the Kaggle shape (26 Criteo Kaggle cardinalities, 33.8M rows, dim 16, bottom 512-256-64-16, top 512-256-1,
            batch 2048, row-wise Adagrad), the 8 tables over 4 MiB on disk: step time of the disk tier / the
            in-memory step (same batches, same process), at cache 1, 5, 10, 25, 50 % and Zipf exponents 0.8, 1.05,
            1.2 (`--kaggle_fill N`: the disk arms first replay N batches through their cache without the model step,
            so the cache is at the state a long run leaves it in); hit rate, rows and bytes read and written per
            step, the share of the cache filled, the host's time reading misses per step, and at
            Zipf 1.05 / cache 10 % the same step without the overlap (tiering.prefetch=False): the share of the miss
            time the prefetch hides = (no-overlap - overlap) / (no-overlap - memory).
  mlperf52  the MLPerf DLRMv2 table set (experiments/configs/dlrm_synthetic.py:mlperf52, 52.3 GB of f32 rows) trained
            with its six large tables on disk, beside the same model with every table capped at --cap rows in memory
            (the speed goal's reference) and the full table set compressed with QR (--qr_collisions) to fit in memory
            (the "compress or offload" row): examples/s, test AUC, hit rate, peak RSS and its split (the process's
            own memory, file-backed pages) of each run (each in its own process: `python -m experiments.train`,
            --mlperf_steps from scratch). Then the steady state (--mlperf_window > 0): the disk arm's cache filled by
            a replay of batches without the model step until every slot holds a row or the warm-up's misses fill the
            rest (at most --mlperf_fill batches, then batches of uniform ids fill what is left; `cache_full_at_window`
            says how full the window began),
            then --mlperf_window train steps timed, beside as many steps of the capped arm (each arm in its own
            process): examples/s and its ratio to the capped arm's, hit rate, rows read / written and evictions /
            write-backs per step, the peaks of RssAnon and RssFile over the window and the process. --vocab_cap and
            --disk_over shrink the preset for a smoke run.
  mesh      the disk tier on a mesh (recjax/tiering/slots.py `BlockSlots`): the synthetic default (26 tables, dim 16)
            on 8 CPU devices (data=4 x model=2), every table row-wise, trained by the launcher in memory and with every
            table on disk behind a cache of --mesh_cache of the rows the fullest device owns, on each device:
            examples/s of both and their ratio, AUC and logloss of both (equal: the runs are bit-identical), hit rate,
            rows read and written (each run in its own process: `python -m experiments.train --cpu_devices=8`).
  plot      tiering.png beside --out: step-time ratio and hit rate against cache size, one line per Zipf exponent.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import pathlib
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's recjax, not an installed one
SECTIONS = ("engines", "floor", "kaggle", "mlperf52", "mesh", "plot")
OUT: pathlib.Path | None = None


def _log(message: str) -> None:
    print(f"[tiering] {message}", file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    import jax

    return {"cpu_count": os.cpu_count(), "jax": jax.__version__, "backend": jax.default_backend(),
            "load_average": round(os.getloadavg()[0], 1)}


def emit(record: dict) -> None:
    line = json.dumps({**record, "machine": machine()})
    print(line, flush=True)
    if OUT is not None:
        with OUT.open("a") as f:
            f.write(line + "\n")


def rss_file() -> int:
    """This process's file-backed resident bytes (RssFile in /proc/self/status)."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    return 0


def drop_page_cache(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------- engines
def engines(directory: pathlib.Path, rows: int = 1_000_000, width: int = 65, batch: int = 8192,
            batches: int = 6, threads: int = 16) -> None:
    rng = np.random.default_rng(0)
    data = rng.standard_normal((rows, width), dtype=np.float32)
    picks = [np.sort(rng.choice(rows, batch, replace=False)) for _ in range(batches)]
    values = rng.standard_normal((batch, width), dtype=np.float32)
    record_bytes = width * 4
    pool = ThreadPoolExecutor(threads)

    def rate(op, n=batches) -> float:
        start = time.perf_counter()
        for b in picks[:n]:
            op(b)
        return n * batch / (time.perf_counter() - start)

    def split(n):
        return np.array_split(np.arange(n), threads)

    path = directory / "engine.f32"
    data.tofile(path)

    # The file mapped, numpy gathers / scatters over the pool: main's store until a truncated file killed a run with
    # SIGBUS (a mapped page past the end of the file). RssFile's growth after the first batch: what its 8,192 rows
    # mapped, against the 32 MiB a page per row would be.
    fd = os.open(path, os.O_RDWR)
    region = mmap.mmap(fd, rows * record_bytes)
    region.madvise(mmap.MADV_RANDOM)
    mapped = np.frombuffer(region, np.float32).reshape(rows, width)

    def mapped_read(r):
        out = np.empty((len(r), width), np.float32)
        list(pool.map(lambda p: out.__setitem__(p, mapped[r[p]]), split(len(r))))
        return out

    def mapped_write(r):
        list(pool.map(lambda p: mapped.__setitem__(r[p], values[p]), split(len(r))))

    rss0 = rss_file()
    assert np.array_equal(mapped_read(picks[0]), data[picks[0]])
    first = rss_file() - rss0
    warm_read, write = rate(mapped_read), rate(mapped_write)
    region.flush()
    region.madvise(mmap.MADV_DONTNEED)
    drop_page_cache(path)
    cold = rate(mapped_read, 3)
    emit({"section": "engines", "engine": "mmap + numpy, 16 threads (SIGBUS on a truncated file)",
          "warm_read_rows_s": warm_read, "write_rows_s": write, "cold_read_rows_s": cold,
          "rss_file_first_batch_bytes": first, "record_bytes": record_bytes})

    # The kernel copying rows through the same mapping: process_vm_readv / writev on this process's own memory,
    # 1,024 rows a call, over the pool. A fault it cannot serve (a page past the end of a truncated file) ends the
    # call early instead of raising SIGBUS.
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        calls = [libc.process_vm_readv, libc.process_vm_writev]
        for call in calls:
            call.restype = ctypes.c_ssize_t
            call.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                             ctypes.c_ulong]
        base = mapped.ctypes.data

        def through_kernel(write: bool, r, buffer) -> None:
            def work(p):
                for at in range(0, len(p), 1024):
                    part = p[at: at + 1024]
                    mine = np.empty((len(part), 2), np.uint64)
                    mine[:, 0] = buffer.ctypes.data + part.astype(np.uint64) * np.uint64(record_bytes)
                    mine[:, 1] = record_bytes
                    theirs = np.empty((len(part), 2), np.uint64)
                    theirs[:, 0] = base + r[part].astype(np.uint64) * np.uint64(record_bytes)
                    theirs[:, 1] = record_bytes
                    done = calls[write](os.getpid(), mine.ctypes.data, len(part), theirs.ctypes.data, len(part), 0)
                    assert done == len(part) * record_bytes, (done, ctypes.get_errno())

            list(pool.map(work, split(len(r))))

        def vm_read(r):
            out = np.empty((len(r), width), np.float32)
            through_kernel(False, r, out)
            return out

        data.tofile(path)
        drop_page_cache(path)
        rss0 = rss_file()
        assert np.array_equal(vm_read(picks[0]), data[picks[0]])
        first = rss_file() - rss0
        warm_read, write = rate(vm_read), rate(lambda r: through_kernel(True, r, values))
        region.flush()
        region.madvise(mmap.MADV_DONTNEED)
        drop_page_cache(path)
        cold = rate(vm_read, 3)
        emit({"section": "engines", "engine": "mmap + process_vm_readv / writev, 16 threads", "warm_read_rows_s":
              warm_read, "write_rows_s": write, "cold_read_rows_s": cold, "rss_file_first_batch_bytes": first,
              "record_bytes": record_bytes})
    mapped = None  # the mapping cannot close while an array exports it
    region.close()
    os.close(fd)

    # The store itself (recjax/tiering/store.py): pread / pwrite a row per call over its pool.
    from recjax.tiering.store import RowStore

    (directory / "store").mkdir(exist_ok=True)
    store = RowStore([("T", 0, rows, directory / "store")], width, threads)
    start = time.perf_counter()
    store.write_initial(0, data)
    initial_s = time.perf_counter() - start
    store.open()
    rss0 = rss_file()
    assert np.array_equal(store.read(picks[0]), data[picks[0]])
    warm_read, write = rate(store.read), rate(lambda r: store.write(r, values))
    drop_page_cache(directory / "store" / "T.f32")
    cold = rate(store.read, 3)
    emit({"section": "engines", "engine": f"store: pread / pwrite a row per call, {threads} threads (recjax)",
          "warm_read_rows_s": warm_read, "write_rows_s": write, "cold_read_rows_s": cold,
          "rss_file_growth_bytes": rss_file() - rss0, "initial_write_s": initial_s, "record_bytes": record_bytes})
    # A full cache's write-back: a tenth of the rows, dirty, on pages the page cache does not hold -- sorted and
    # dense, so the store writes them by spans of the file, against the same rows shuffled (a write per row).
    dense = np.sort(rng.choice(rows, rows // 10, replace=False))
    dense_values = rng.standard_normal((len(dense), width), dtype=np.float32)
    written = {}
    for label, order in (("by_row", rng.permutation(len(dense))), ("by_span", np.arange(len(dense)))):
        drop_page_cache(directory / "store" / "T.f32")
        start = time.perf_counter()
        store.write(dense[order], dense_values[order])
        written[label] = len(dense) / (time.perf_counter() - start)
    assert np.array_equal(store.read(dense), dense_values)
    emit({"section": "engines", "engine": "store: a write-back of a tenth of the rows, cold pages",
          "write_back_rows_s_by_row": written["by_row"], "write_back_rows_s_by_span": written["by_span"],
          "rows": len(dense), "record_bytes": record_bytes})
    store.close()
    shutil.rmtree(directory / "store")

    keys = np.arange(rows, dtype=">u8").tobytes()

    def key_list(r):
        raw = r.astype(">u8").tobytes()
        return [raw[8 * i: 8 * i + 8] for i in range(len(r))]

    with contextlib.suppress(ImportError):
        import lmdb

        env = lmdb.open(str(directory / "lmdb"), map_size=4 << 30, readahead=False, sync=False)
        start = time.perf_counter()
        with env.begin(write=True) as txn:
            for i in range(rows):
                txn.put(keys[8 * i: 8 * i + 8], data[i].tobytes(), append=True)
        load = rows / (time.perf_counter() - start)

        def lmdb_read(r):
            with env.begin() as txn:
                return np.frombuffer(b"".join(txn.get(k) for k in key_list(r)), np.float32).reshape(-1, width)

        def lmdb_write(r):
            with env.begin(write=True) as txn:
                for k, v in zip(key_list(r), values, strict=True):
                    txn.put(k, v.tobytes())

        assert np.array_equal(lmdb_read(picks[0]), data[picks[0]])
        emit({"section": "engines", "engine": "LMDB (python lmdb)", "warm_read_rows_s": rate(lmdb_read),
              "write_rows_s": rate(lmdb_write), "load_rows_s": load, "record_bytes": record_bytes})
        env.close()

    with contextlib.suppress(ImportError):
        from rocksdict import Options, Rdict, WriteBatch

        db = Rdict(str(directory / "rocks"), Options(raw_mode=True))
        start = time.perf_counter()
        for s in range(0, rows, 65536):
            wb = WriteBatch(raw_mode=True)
            for i in range(s, min(rows, s + 65536)):
                wb.put(keys[8 * i: 8 * i + 8], data[i].tobytes())
            db.write(wb)
        load = rows / (time.perf_counter() - start)

        def rocks_read(r):
            return np.frombuffer(b"".join(db[key_list(r)]), np.float32).reshape(-1, width)

        def rocks_write(r):
            wb = WriteBatch(raw_mode=True)
            for k, v in zip(key_list(r), values, strict=True):
                wb.put(k, v.tobytes())
            db.write(wb)

        assert np.array_equal(rocks_read(picks[0]), data[picks[0]])
        emit({"section": "engines", "engine": "RocksDB (rocksdict)", "warm_read_rows_s": rate(rocks_read),
              "write_rows_s": rate(rocks_write), "load_rows_s": load, "record_bytes": record_bytes})
        db.close()

    with contextlib.suppress(ImportError):
        import tensorstore as ts

        array = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(directory / "ts")}},
                        dtype=ts.float32, shape=[rows, width], create=True, delete_existing=True,
                        chunk_layout=ts.ChunkLayout(chunk_shape=[256, width])).result()
        start = time.perf_counter()
        array.write(data).result()
        load = rows / (time.perf_counter() - start)
        assert np.array_equal(array[picks[0]].read().result(), data[picks[0]])
        emit({"section": "engines", "engine": "tensorstore (zarr3, 256-row chunks)",
              "warm_read_rows_s": rate(lambda r: array[r].read().result(), 2),
              "write_rows_s": rate(lambda r: array[r].write(values).result(), 1), "load_rows_s": load,
              "record_bytes": record_bytes})
    pool.shutdown()


# ------------------------------------------------------------------------------------------------------ floor
def floor(directory: pathlib.Path, size: int = 2 << 30) -> None:
    path = directory / "floor.bin"
    block = os.urandom(1 << 20)
    start = time.perf_counter()
    with path.open("wb") as f:
        for _ in range(size >> 20):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write_mb_s = size / 2**20 / (time.perf_counter() - start)
    drop_page_cache(path)
    fd = os.open(path, os.O_RDONLY)
    start, n = time.perf_counter(), 0
    while chunk := os.read(fd, 1 << 20):
        n += len(chunk)
    read_mb_s = n / 2**20 / (time.perf_counter() - start)
    result = {"section": "floor", "dropped_with": "posix_fadvise(DONTNEED)", "sequential_read_mb_s": read_mb_s,
              "sequential_write_mb_s_fsync": write_mb_s}
    for in_flight in (1, 16):
        drop_page_cache(path)
        offsets = [random.randrange(size >> 12) << 12 for _ in range(4000 if in_flight == 1 else 16000)]
        parts = [offsets[i::in_flight] for i in range(in_flight)]

        def work(part):
            for o in part:
                os.pread(fd, 4096, o)

        start = time.perf_counter()
        with ThreadPoolExecutor(in_flight) as ex:
            list(ex.map(work, parts))
        result[f"random_4k_reads_s_{in_flight}_in_flight"] = len(offsets) / (time.perf_counter() - start)
    os.close(fd)
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        result["o_direct"] = "opens"
    except OSError as error:
        result["o_direct"] = f"refused: {error.strerror}"
    path.unlink()
    emit(result)


# ----------------------------------------------------------------------------------------------------- kaggle
def kaggle_config(zipf: float, tiered: bool, cache: float, prefetch: bool = True, vocab_cap: int = 0):
    from experiments.configs.dlrm_synthetic import get_config

    config = get_config("kaggle")
    if vocab_cap:  # a smaller table set (smoke runs)
        config.data.vocab_sizes = tuple(min(v, vocab_cap) for v in config.data.vocab_sizes)
    config.data.zipf_exponent = zipf
    config.optimizer = get_config("mlperf52").optimizer  # row-wise Adagrad: 4 bytes of state a row
    config.train.batch_size = 2048
    config.checkpoint.enabled = False
    if tiered:
        config.tiering.disk_over_bytes = 4 * 2**20
        config.tiering.cache_fraction = cache
        config.tiering.prefetch = prefetch
    return config


def time_steps(config, directory: pathlib.Path, host_batches, warmup: int, fill=None) -> dict:
    """Median and mean step time over the batches after `warmup`, run as the trainer does (batches placed on the
    prefetch thread, at most `steps_in_flight` steps queued). `fill` (the disk tier): batches replayed through the
    cache before them without the model step -- each one's rows planned, its misses read and its victims written
    back exactly as a train step's (every row a step uses is dirty), so the cache reaches the state thousands of
    training steps leave it in, at the cost of the host's I/O alone."""
    import jax

    from recjax import placement
    from recjax.data.pipeline import DevicePrefetcher
    from recjax.specs import DatasetSpec, FeatureSpec
    from recjax.step import init_state, make_train_step
    from recjax.task import build_task

    spec = DatasetSpec(num_dense=13, features=tuple(FeatureSpec(f"C{i + 1}", v)
                                                    for i, v in enumerate(config.data.vocab_sizes)))
    task = build_task(config, spec)
    config.tiering.dir = str(directory)
    backend = placement.build(config, task)
    disk = next((s for s in backend.storages if s.name == "disk"), None)
    try:
        t0 = time.perf_counter()
        with DevicePrefetcher(iter(host_batches), lambda b, w: None, put=backend.put_batch) as batches:
            first = next(batches)
            state = backend.place_state(init_state(task, jax.random.key(0), host_batches[0], backend))
            init_s = time.perf_counter() - t0
            filled, fill_s = 0, 0.0
            if fill is not None and disk is not None:
                t1 = time.perf_counter()
                for b in fill:
                    state, _ = disk.prepare_train(state, backend.put_batch(b))
                    filled += 1
                    if filled % 50 == 0:  # keep the queued swaps few
                        jax.block_until_ready(state.tables)
                jax.block_until_ready(state.tables)
                fill_s = time.perf_counter() - t1
            step = make_train_step(task, backend, state).lower(state, first).compile()
            in_flight, batch = [], first
            stats_at = None
            for i in range(len(host_batches)):
                if i == warmup:
                    jax.block_until_ready(state)
                    stats_at = json.loads(json.dumps(backend.summary()))
                    start = time.perf_counter()
                state, metrics = step(state, batch)
                in_flight.append(metrics["loss"])
                if len(in_flight) > 2:
                    in_flight.pop(0).block_until_ready()
                if i + 1 < len(host_batches):
                    batch = next(batches)
            jax.block_until_ready(state)
            elapsed = time.perf_counter() - start
        steps = len(host_batches) - warmup
        out = {"step_ms": 1000 * elapsed / steps, "init_s": init_s, "steps": steps}
        summary = backend.summary()
        if "tiering" in summary:
            (g0, before), = stats_at["tiering"]["groups"].items()
            occupied = int((disk.caches[g0].row_of_slot >= 0).sum())
            out.update({"fill_steps": filled, "fill_s": fill_s, "cache_full": occupied / before["cache_slots"]})
            after = summary["tiering"]["groups"][g0]
            lookups = after["lookups"] - before["lookups"]
            width_bytes = after["bytes_read"] / max(after["rows_read"], 1)
            out.update({
                "hit_rate": (after["hits"] - before["hits"]) / max(lookups, 1),
                "rows_read_per_step": (after["rows_read"] - before["rows_read"]) / steps,
                "rows_written_per_step": (after["rows_written"] - before["rows_written"]) / steps,
                "bytes_read_per_step": (after["rows_read"] - before["rows_read"]) * width_bytes / steps,
                "bytes_written_per_step": (after["rows_written"] - before["rows_written"]) * width_bytes / steps,
                "read_ms_per_step": 1000 * (summary["tiering"]["read_s"] - stats_at["tiering"]["read_s"]) / steps,
                "plan_ms_per_step": 1000 * (summary["tiering"]["plan_s"] - stats_at["tiering"]["plan_s"]) / steps,
                "write_ms_per_step": 1000 * (summary["tiering"]["write_s"] - stats_at["tiering"]["write_s"]) / steps,
                "queue_wait_ms_per_step": 1000 * (summary["tiering"]["queue_wait_s"]
                                                  - stats_at["tiering"]["queue_wait_s"]) / steps,
                "cache_slots": after["cache_slots"], "cached_rows": after["cached_rows"]})
        return out
    finally:
        backend.close()


def kaggle(directory: pathlib.Path, zipfs, caches, steps: int, warmup: int, vocab_cap: int = 0, fill: int = 0
           ) -> None:
    """`fill` > 0: the disk arms first replay the run's first `fill` batches through their cache (`time_steps`), and
    every arm then times the batches after them."""
    import itertools

    from recjax.data.synthetic import SyntheticDataset

    for zipf in zipfs:
        config = kaggle_config(zipf, False, 0.0, vocab_cap=vocab_cap)
        data = SyntheticDataset(vocab_sizes=config.data.vocab_sizes, zipf_exponent=zipf, eval_examples=16, seed=0)
        stream = data.train_batches(2048, start_step=fill)
        host_batches = [next(stream) for _ in range(warmup + steps)]
        _log(f"kaggle zipf {zipf}: memory")
        memory = time_steps(config, directory, host_batches, warmup)
        emit({"section": "kaggle", "zipf": zipf, "cache": 0, "tier": "memory", **memory})
        for cache in caches:
            runs = [True] + ([False] if zipf == 1.05 and cache == 0.1 else [])
            for prefetch in runs:
                _log(f"kaggle zipf {zipf}: cache {cache:.0%}, prefetch {prefetch}")
                tiered = time_steps(kaggle_config(zipf, True, cache, prefetch, vocab_cap), directory, host_batches,
                                    warmup, itertools.islice(data.train_batches(2048), fill) if fill else None)
                emit({"section": "kaggle", "zipf": zipf, "cache": cache, "tier": "disk", "prefetch": prefetch,
                      "memory_step_ms": memory["step_ms"], "ratio": tiered["step_ms"] / memory["step_ms"], **tiered})


# --------------------------------------------------------------------------------------------------- mlperf52
def mlperf52(directory: pathlib.Path, steps: int, cap: int, qr_collisions: int, eval_examples: int,
             vocab_cap: int = 0, disk_over: int = 0, window: int = 0, warmup: int = 5, fill: int = 0) -> None:
    """The three arms trained by the launcher from scratch, then (`window` > 0) the steady state: the disk arm's
    cache filled by a replay of up to `fill` batches, then `window` train steps timed, beside the capped arm's
    `window` steps (`steady_window`, each arm in its own process). `vocab_cap` / `disk_over` shrink the preset
    (smoke runs: every table capped at `vocab_cap` rows, the disk rule at `disk_over` bytes)."""
    from recjax.data.synthetic import MLPERF_VOCAB_SIZES

    vocab = tuple(min(v, vocab_cap) for v in MLPERF_VOCAB_SIZES) if vocab_cap else MLPERF_VOCAB_SIZES
    capped = tuple(min(v, cap) for v in vocab)
    common = [f"--config.train.steps={steps}", f"--config.train.eval_every={steps}", "--config.train.log_every=25",
              f"--config.data.eval_examples={eval_examples}", "--config.train.progress_bar=False"]
    shrunk = [f"--config.data.vocab_sizes={vocab}"] if vocab_cap else []
    arms = {
        "disk": [*shrunk, f"--config.tiering.dir={directory / 'mlperf52'}",
                 *([f"--config.tiering.disk_over_bytes={disk_over}"] if disk_over else [])],
        "capped_memory": [f"--config.data.vocab_sizes={capped}", "--config.tiering.disk_over_bytes=0"],
        "qr_memory": [*shrunk, "--config.embedding.method=qr", f"--config.embedding.options.collisions={qr_collisions}",
                      "--config.tiering.disk_over_bytes=0"],
    }
    for arm, extra in arms.items() if steps else ():
        workdir = directory / f"run_{arm}"
        command = [sys.executable, "-m", "experiments.train", "--config=experiments/configs/dlrm_synthetic.py:mlperf52",
                   f"--workdir={workdir}", *common, *extra]
        _log(f"mlperf52 {arm}: {' '.join(command[2:])}")
        start = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - start
        (directory / f"{arm}.log").write_text(done.stdout + done.stderr)
        if done.returncode:
            emit({"section": "mlperf52", "arm": arm, "error": (done.stdout + done.stderr)[-2000:], "wall_s": wall})
            continue
        summary = json.loads((workdir / "summary.json").read_text())
        record = {"section": "mlperf52", "arm": arm, "command": " ".join(command[2:]), "wall_s": wall,
                  **{k: summary[k] for k in ("examples_per_sec", "auc", "logloss", "peak_rss_bytes",
                                             "peak_rss_anon_bytes", "peak_rss_file_bytes", "embedding_bytes",
                                             "embedding_optimizer_bytes", "compile_time_s", "train_time_s", "steps",
                                             "batch_size", "bayes_auc")}}
        if "tiering" in summary:
            (group, stats), = summary["tiering"]["groups"].items()
            record.update({"hit_rate": stats["hit_rate"], "cache_slots": stats["cache_slots"],
                           "rows_read": stats["rows_read"], "rows_written": stats["rows_written"],
                           "evictions": stats["evictions"], "writebacks": stats["writebacks"],
                           "read_s": summary["tiering"]["read_s"], "plan_s": summary["tiering"]["plan_s"]})
        emit(record)
        shutil.rmtree(directory / "mlperf52", ignore_errors=True)
    if not window:
        return
    results = {}
    for arm in ("capped_memory", "disk"):
        params = {"arm": arm, "cap": cap, "vocab_cap": vocab_cap, "disk_over": disk_over, "window": window,
                  "warmup": warmup, "fill": fill, "directory": str(directory / "mlperf52_window")}
        _log(f"mlperf52 steady state, {arm}: {params}")
        start = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, "--child", json.dumps(params)], cwd=REPO,
                              capture_output=True, text=True)
        (directory / f"window_{arm}.log").write_text(done.stdout + done.stderr)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            emit({"section": "mlperf52", "arm": f"{arm}, steady state", "error": (done.stdout + done.stderr)[-2000:]})
            return
        results[arm] = {"section": "mlperf52", "arm": f"{arm}, steady state", **json.loads(lines[-1]),
                        "wall_s": time.perf_counter() - start}
        if arm == "disk":
            results[arm]["capped_examples_per_sec"] = results["capped_memory"]["examples_per_sec"]
            results[arm]["ratio_to_capped"] = (results[arm]["examples_per_sec"]
                                               / results["capped_memory"]["examples_per_sec"])
        emit(results[arm])
        shutil.rmtree(directory / "mlperf52_window", ignore_errors=True)


def steady_window(arm: str, cap: int, vocab_cap: int, disk_over: int, window: int, warmup: int, fill: int,
                  directory: str) -> dict:
    """One arm of the mlperf52 preset at steady state, in this process (the parent runs each arm in a child of its
    own, so the RSS figures are the arm's): the disk arm's cache is filled first by replaying batches through it
    without the model step (each batch's rows planned, its misses read and its victims written back as a train step
    does; `time_steps`), until every slot holds a row -- from then on every miss evicts and writes a row back -- or
    the free slots are fewer than the warm-up's misses will take (at the replay's last rate), or `fill` batches;
    slots still free then are filled by batches of uniform ids (`fill_uniform_steps`); then `warmup` train steps
    and `window` timed ones, run as the trainer runs them (batches placed on the prefetch thread, two steps in
    flight); the window's figures are printed before the final write-back. Examples/s, hit rate, rows read /
    written and evictions / write-backs per step over the window; the peaks of the process's own memory (RssAnon)
    and of its file-backed pages (RssFile), over the window and over the whole process, sampled on a thread
    (recjax/rss.py)."""
    import jax

    from experiments.configs.dlrm_synthetic import get_config
    from recjax import placement
    from recjax.data.pipeline import DevicePrefetcher
    from recjax.data.synthetic import SyntheticDataset
    from recjax.rss import RssSampler, resident
    from recjax.specs import DatasetSpec, FeatureSpec
    from recjax.step import init_state, make_train_step
    from recjax.task import build_task

    process = RssSampler().start()
    config = get_config("mlperf52")
    if vocab_cap:
        config.data.vocab_sizes = tuple(min(v, vocab_cap) for v in config.data.vocab_sizes)
    if arm == "capped_memory":
        config.data.vocab_sizes = tuple(min(v, cap) for v in config.data.vocab_sizes)
        config.tiering.disk_over_bytes = 0
    elif disk_over:
        config.tiering.disk_over_bytes = disk_over
    config.tiering.dir = directory
    batch_size = int(config.train.batch_size)
    spec = DatasetSpec(num_dense=13, features=tuple(FeatureSpec(f"C{i + 1}", v)
                                                    for i, v in enumerate(config.data.vocab_sizes)))
    task = build_task(config, spec)
    data = SyntheticDataset(vocab_sizes=config.data.vocab_sizes, zipf_exponent=config.data.zipf_exponent,
                            eval_examples=16, seed=0)
    stream = data.train_batches(batch_size)
    backend = placement.build(config, task)
    disk = next((s for s in backend.storages if s.name == "disk"), None)
    try:
        t0 = time.perf_counter()
        first = next(stream)
        state = backend.place_state(init_state(task, jax.random.key(0), first, backend))
        jax.block_until_ready(state)
        out = {"init_s": time.perf_counter() - t0, "batch_size": batch_size, "window_steps": window,
               "embedding_rows": int(sum(config.data.vocab_sizes))}
        caches = disk.caches if disk is not None else {}
        if caches:
            t0, filled, read_at = time.perf_counter(), 0, 0
            for batch in stream:
                state, _ = disk.prepare_train(state, backend.put_batch(batch))
                filled += 1
                if filled % 20 == 0 or filled >= fill:
                    jax.block_until_ready(state.tables)  # keep the queued swaps few
                    # Full, or so nearly that the warm-up's misses (at the last 20 batches' rate) take the rest.
                    read = sum(s.rows_read for s in disk.stores.values())
                    misses, read_at = (read - read_at) / 20, read
                    if sum(c.free for c in caches.values()) <= warmup * misses or filled >= fill:
                        break
            # The last free slots: a long-tailed stream fills them slowly (a few hundred new rows a batch), so
            # batches of uniform ids fill them -- with rows no better than a long run's would be, so the window's
            # hit rate is if anything lower than at a true steady state.
            uniform = SyntheticDataset(vocab_sizes=config.data.vocab_sizes, zipf_exponent=0.0, eval_examples=16,
                                       seed=1).train_batches(batch_size)
            spread = 0
            while sum(c.free for c in caches.values()) > 0 and spread < 10_000:
                state, _ = disk.prepare_train(state, backend.put_batch(next(uniform)))
                spread += 1
                if spread % 20 == 0:
                    jax.block_until_ready(state.tables)
            jax.block_until_ready(state.tables)
            # The replay's queued write-backs done before the window; its rows stay dirty in the cache, as a long
            # run's do (every row a step uses is), so from the window's first step a miss evicts a dirty row.
            disk._drain()
            out.update({"fill_steps": filled, "fill_uniform_steps": spread, "fill_s": time.perf_counter() - t0,
                        "cache_full": min(1 - c.free / c.size for c in caches.values()),
                        "cache_slots": sum(c.size for c in caches.values()),
                        "cached_rows": sum(disk.layouts[g].cached_rows for g in caches)})
        host = [next(stream) for _ in range(warmup + window)]
        with DevicePrefetcher(iter(host), lambda b, w: None, put=backend.put_batch) as batches:
            batch = next(batches)
            step = make_train_step(task, backend, state).lower(state, batch).compile()
            in_flight, before, window_rss = [], None, None
            for i in range(warmup + window):
                if i == warmup:
                    jax.block_until_ready(state)
                    before = json.loads(json.dumps(backend.summary()))
                    if caches:
                        out["cache_full_at_window"] = min(1 - c.free / c.size for c in caches.values())
                    window_rss = RssSampler().start()
                    start = time.perf_counter()
                state, metrics = step(state, batch)
                in_flight.append(metrics["loss"])
                if len(in_flight) > 2:
                    in_flight.pop(0).block_until_ready()
                if i + 1 < warmup + window:
                    batch = next(batches)
            jax.block_until_ready(state)
            elapsed = time.perf_counter() - start
        window_rss.stop()
        out.update({"examples_per_sec": window * batch_size / elapsed, "step_ms": 1000 * elapsed / window,
                    "window_peak_rss_anon_bytes": window_rss.peaks["anon"],
                    "window_peak_rss_file_bytes": window_rss.peaks["file"],
                    "window_peak_rss_bytes": window_rss.peaks["total"]})
        after = backend.summary()
        if "tiering" in after:
            lookups = hits = 0
            for g, stats in after["tiering"]["groups"].items():
                was = before["tiering"]["groups"][g]
                lookups += stats["lookups"] - was["lookups"]
                hits += stats["hits"] - was["hits"]
                for key in ("rows_read", "rows_written", "evictions", "writebacks"):
                    out[f"{key}_per_step"] = out.get(f"{key}_per_step", 0) + (stats[key] - was[key]) / window
            out["hit_rate"] = hits / max(lookups, 1)
            for key in ("read_s", "plan_s", "write_s", "queue_wait_s"):
                out[f"{key[:-2]}_ms_per_step"] = 1000 * (after["tiering"][key] - before["tiering"][key]) / window
        # The window's figures now (the final write-back of a full cache can take minutes), then the whole line.
        print(json.dumps({"stage": "window", **out}), flush=True)
        t0 = time.perf_counter()
        backend.finish(state)  # the final write-back (files kept under --dir): its memory counts too
        out["finish_s"] = time.perf_counter() - t0
    finally:
        backend.close()
    now = resident() or {}
    out.update({"peak_rss_bytes": now.get("peak"), "peak_rss_anon_bytes": process.summary()["peak_rss_anon_bytes"],
                "peak_rss_file_bytes": process.summary()["peak_rss_file_bytes"]})
    process.stop()
    return out


# ------------------------------------------------------------------------------------------------------- mesh
def mesh(directory: pathlib.Path, steps: int, batch_size: int, cache: float) -> None:
    common = ["--cpu_devices=8", "--config.mesh.shape=data=4,model=2", "--config.sharding.plan=row",
              f"--config.train.batch_size={batch_size}", f"--config.train.steps={steps}",
              "--config.checkpoint.enabled=False", "--config.train.progress_bar=False"]
    arms = {"memory": [], "disk": ["--config.tiering.default=disk", f"--config.tiering.cache_fraction={cache}",
                                   f"--config.tiering.dir={directory / 'mesh_tables'}"]}
    results = {}
    for arm, extra in arms.items():
        workdir = directory / f"mesh_{arm}"
        command = [sys.executable, "-m", "experiments.train", f"--workdir={workdir}", *common, *extra]
        _log(f"mesh {arm}: {' '.join(command[2:])}")
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if done.returncode:
            emit({"section": "mesh", "arm": arm, "error": (done.stdout + done.stderr)[-2000:]})
            return
        summary = json.loads((workdir / "summary.json").read_text())
        record = {"section": "mesh", "arm": arm, "command": " ".join(command[2:]),
                  **{k: summary[k] for k in ("examples_per_sec", "auc", "logloss", "final_train_loss",
                                             "peak_rss_bytes", "compile_time_s", "train_time_s", "steps",
                                             "batch_size")}}
        if "tiering" in summary:
            (_, stats), = summary["tiering"]["groups"].items()
            record.update({k: stats[k] for k in ("hit_rate", "cache_slots", "cached_rows", "devices", "rows_read",
                                                 "rows_written")})
            record.update({"read_s": summary["tiering"]["read_s"], "plan_s": summary["tiering"]["plan_s"],
                           "memory_examples_per_sec": results["memory"]["examples_per_sec"]})
            record["ratio"] = record["examples_per_sec"] / record["memory_examples_per_sec"]
            record["same_auc"] = record["auc"] == results["memory"]["auc"]
        results[arm] = record
        emit(record)
    shutil.rmtree(directory / "mesh_tables", ignore_errors=True)


# ------------------------------------------------------------------------------------------------------- plot
def plot(results: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    rows = [r for r in lines if r.get("section") == "kaggle" and r.get("tier") == "disk" and r.get("prefetch")]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for zipf in sorted({r["zipf"] for r in rows}):
        points = sorted((r["cache"], r["ratio"], r["hit_rate"]) for r in rows if r["zipf"] == zipf)
        x = [100 * p[0] for p in points]
        left.plot(x, [p[1] for p in points], marker="o", label=f"Zipf {zipf}")
        right.plot(x, [p[2] for p in points], marker="o", label=f"Zipf {zipf}")
    for axis, label in ((left, "disk-tier step / in-memory step"), (right, "cache hit rate")):
        axis.set_xscale("log")
        axis.set_xlabel("cache size (% of the disk tables' rows)")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
        axis.legend()
    left.axhline(1.5, color="gray", linestyle="--", linewidth=0.8)
    fig.suptitle("Kaggle shape, batch 2048: the disk tier against memory")
    fig.tight_layout()
    path = results.with_suffix(".png")
    fig.savefig(path, dpi=120)
    _log(f"wrote {path}")


def main() -> None:
    global OUT
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    parser.add_argument("--out", default="", help="also append the JSON lines here (the plot reads them)")
    parser.add_argument("--dir", default="", help="where table files go (default: a temporary directory)")
    parser.add_argument("--zipfs", default="1.05,0.8,1.2")
    parser.add_argument("--caches", default="0.01,0.05,0.1,0.25,0.5")
    parser.add_argument("--kaggle_steps", type=int, default=40, help="timed steps per kaggle run")
    parser.add_argument("--kaggle_warmup", type=int, default=20, help="untimed steps first (the cache fills)")
    parser.add_argument("--vocab_cap", type=int, default=0, help="kaggle: cap every table at this many rows (smoke)")
    parser.add_argument("--kaggle_fill", type=int, default=0,
                        help="kaggle: batches replayed through each disk arm's cache before the warm-up (no model "
                             "step: the cache's steady state in minutes); every arm is timed on the batches after")
    parser.add_argument("--mlperf_steps", type=int, default=300, help="mlperf52: steps the launcher trains each arm "
                                                                        "from scratch (0: skip those arms)")
    parser.add_argument("--mlperf_window", type=int, default=50, help="mlperf52: train steps timed at steady state "
                                                                      "(the disk arm's cache full), beside the capped "
                                                                      "arm's (0: skip)")
    parser.add_argument("--mlperf_warmup", type=int, default=5, help="mlperf52: untimed steps before the window")
    parser.add_argument("--mlperf_fill", type=int, default=40_000, help="mlperf52: at most this many batches "
                                                                         "replayed to fill the disk arm's cache")
    parser.add_argument("--disk_over", type=int, default=0, help="mlperf52: tiering.disk_over_bytes (0: the "
                                                                 "preset's 256 MiB; smoke runs with --vocab_cap)")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--cap", type=int, default=4_000_000, help="rows per table of the capped in-memory arm")
    parser.add_argument("--qr_collisions", type=int, default=16, help="QR arm: ids per quotient row")
    parser.add_argument("--eval_examples", type=int, default=65536)
    parser.add_argument("--mesh_steps", type=int, default=600)
    parser.add_argument("--mesh_batch", type=int, default=256, help="mesh: the global batch")
    parser.add_argument("--mesh_cache", type=float, default=0.1, help="mesh: tiering.cache_fraction")
    args = parser.parse_args()
    from recjax import cli

    cli.tune_malloc()  # as the launcher does, so the benchmark measures what a run gets
    cli.use_cpu_if_no_accelerator()
    if args.child:  # one mlperf52 arm at steady state, for the parent (`mlperf52`)
        print(json.dumps(steady_window(**json.loads(args.child))), flush=True)
        return
    OUT = pathlib.Path(args.out) if args.out else None
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; use {SECTIONS}")
    directory = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="recjax-tiering-bench-"))
    directory.mkdir(parents=True, exist_ok=True)
    try:
        if "engines" in only:
            engines(directory)
        if "floor" in only:
            floor(directory)
        if "kaggle" in only:
            kaggle(directory, [float(z) for z in args.zipfs.split(",")], [float(c) for c in args.caches.split(",")],
                   args.kaggle_steps, args.kaggle_warmup, args.vocab_cap, args.kaggle_fill)
        if "mlperf52" in only:
            mlperf52(directory, args.mlperf_steps, args.cap, args.qr_collisions, args.eval_examples, args.vocab_cap,
                     args.disk_over, args.mlperf_window, args.mlperf_warmup, args.mlperf_fill)
        if "mesh" in only:
            mesh(directory, args.mesh_steps, args.mesh_batch, args.mesh_cache)
        if "plot" in only and OUT is not None:
            plot(OUT)
    finally:
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
