"""`embedding.kernel = "auto"`: the kernels a run uses, chosen by measurement on its device kind, never slower than XLA.

The first accelerator run (one H200) found the Pallas kernels correct but slower than XLA there, and the old `auto`
(the platform's kernels wherever they exist) picked the slower path (figures: pallas_kernels/README.md). Now `auto`
is decided per device kind and step shape, before the collection is built (`task.build_task` calls
`choose_kernel`), in this order:

  1. a kernel the config names (`xla`, `pallas`, `pallas_tpu`, `pallas_gpu`) is used as named ("config");
  2. on a platform without Pallas kernels (CPU): XLA, nothing measured, nothing changes ("platform");
  3. the cache (`embedding.kernel_cache`: a JSON file keyed by device kind, jax version, KERNELS_REVISION and the
     step's shape class) has this device kind's measured choice for the shape class ("cache");
  4. the shipped table (SHIPPED_CHOICES: choices measured on real chips) has an entry for the device kind ("shipped");
  5. measure ("measured"): the embedding stage of the step -- route (with its dedup), lookups, their backward from a
     fixed cotangent, the sparse update; everything the variants change, the dense model being the same for all --
     is timed on this device for XLA and each Pallas variant (pooling from the gathered distinct rows, or from the
     tables with the fused backward + update), many calls per host sync (`pallas_kernels.timing`). A Pallas variant
     is chosen only when it is at least MARGIN faster than XLA; the choice is written to the cache.
`embedding.kernel_measure = "always"` skips 3 and 4 (and rewrites the cache entry); "never" skips 5, leaving XLA
when 3 and 4 have nothing ("default"). Runs on several devices or processes never measure nor read the cache
(each device would measure alone -- not the mesh's step -- and every process must run the same program): the
shipped table, else XLA. The choice, its source and any timings are `collection.kernel_choice`, which the run's
summary reports as "embedding_kernel".

What a measurement cannot see: it draws uniform ids (real ids are skewed, so a batch has fewer distinct rows and
deduplicating pays more), and it holds the tables only while it runs, before the run allocates its own; tables
(with their optimizer state) larger than MEASURE_MEMORY_FRACTION of the device's memory are not measured (XLA,
with the reason in the record).
"""

import dataclasses
import datetime
import fnmatch
import json
import math
import os
import pathlib
import re
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from pallas_kernels import timing
from pallas_kernels.dispatch import KERNELS_REVISION
from recjax.embedding import (
    KERNEL_MEASURE,
    KERNELS,
    EmbeddingCollection,
    Lookups,
    resolve_dedup,
    resolve_pool_from,
)
from recjax.sections import EmbeddingSection
from recjax.sparse_optim import SparseOptimizer
from recjax.specs import DatasetSpec

# A Pallas variant must be this much faster than XLA to be chosen: timings on a dedicated device repeat within a
# few percent, and a tie goes to XLA (the path every other test and figure runs).
MARGIN = 0.05
# Of the device's memory, what the measurement may hold: one variant's tables and optimizer state at a time.
MEASURE_MEMORY_FRACTION = 0.4
CACHE_VERSION = 1
# The variants `auto` chooses among: (embedding.kernel, embedding.pool_from). "xla" keeps the config's pool_from
# ("auto" resolves to distinct_rows for XLA) and its dedup rule (plain SGD with multi-hot bags: no dedup).
VARIANTS = {"xla": ("xla", None), "pallas_distinct_rows": ("pallas", "distinct_rows"),
            "pallas_table": ("pallas", "table")}
# Choices measured on real chips: (device kind regex, shape class glob, variant, the evidence). The first match wins.
SHIPPED_CHOICES = (
    (r"\bH200\b", "*", "xla",
     "issue 41 (one H200, jax 0.11.2, benchmarks/kernels.py --accelerator): every whole step was slower with the "
     "kernels -- reference_random 1.11-1.29x, Kaggle batch 2048 1.05-1.52x the XLA step"),
    (r"\bH100\b", "*", "xla",
     "not measured on an H100: taken from the H200 (same Hopper SMs, less bandwidth)"),
)

# measure(variants {name: (kernel, pool_from)}) -> {name: seconds per step}; see `measure_variants`.
Measure = Callable[[Mapping[str, tuple[str, str | None]]], dict[str, float]]


@dataclasses.dataclass(frozen=True)
class Device:
    """What the choice depends on about where the run executes."""

    platform: str  # jax's backend name: "cpu", "gpu", "tpu"
    kind: str  # jax.local_devices()[0].device_kind
    devices: int  # devices in the run (all processes)
    memory_bytes: int | None  # the device's memory, where jax reports it


def current_device() -> Device:
    device = jax.local_devices()[0]  # another process's devices answer no memory_stats
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return Device(jax.default_backend(), device.device_kind, jax.device_count(),
                  (stats or {}).get("bytes_limit"))


def default_cache_path() -> pathlib.Path:
    """$RECJAX_CACHE_DIR/kernel_choices.json, else under $XDG_CACHE_HOME (or ~/.cache)/recjax."""
    root = os.environ.get("RECJAX_CACHE_DIR") or pathlib.Path(
        os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "recjax"
    return pathlib.Path(root) / "kernel_choices.json"


def cache_path(setting: str) -> pathlib.Path | None:
    """`embedding.kernel_cache`: "" the default file, "none" no cache, else the file's path."""
    if setting == "none":
        return None
    return pathlib.Path(setting).expanduser() if setting else default_cache_path()


def shape_class(collection: EmbeddingCollection, optimizer: SparseOptimizer, batch_size: int,
                dedup_mode: str = "auto", pool_from: str = "auto") -> str:
    """What the timing of a step's embedding stage depends on, as a key: the sparse optimizer (and whether it decays,
    which decides dedup), the batch, and per stacked group its lookups -- kind, dim, rows (to a power of two) and the
    table reads per bag size. E.g. reference_random: "sgd/b2048/reduce:d64:r2^23:L100x8"."""
    reads: dict[tuple, int] = {}
    for feature, placed in collection.placements.items():
        kind = "reduce" if collection.methods[feature].pools_before_combine else "gather"
        bag = collection.spec.features[collection.spec.feature_names.index(feature)].bag_size
        for p in placed:
            rows = collection.group_rows[p.group]
            key = (kind, p.table.dim, max(0, math.ceil(math.log2(rows))), bag)
            reads[key] = reads.get(key, 0) + 1
    lookups = ",".join(f"{kind}:d{dim}:r2^{rows}:L{bag}x{n}" for (kind, dim, rows, bag), n in sorted(reads.items()))
    name = optimizer.name + ("+wd" if optimizer.weight_decay else "")
    extra = "".join(f"/{k}={v}" for k, v in (("dedup", dedup_mode), ("pool_from", pool_from)) if v != "auto")
    return f"{name}/b{batch_size}/{lookups}{extra}"


def shipped_choice(device_kind: str, klass: str) -> tuple[str, str] | None:
    """(variant, evidence) of the first SHIPPED_CHOICES entry matching the device kind and shape class."""
    for kind_pattern, class_pattern, variant, evidence in SHIPPED_CHOICES:
        if re.search(kind_pattern, device_kind) and fnmatch.fnmatchcase(klass, class_pattern):
            return variant, evidence
    return None


def choose_kernel(embedding: EmbeddingSection, collection: EmbeddingCollection, optimizer: SparseOptimizer,
                  batch_size: int, *, device: Device | None = None, measure: Measure | None = None) -> dict:
    """The record of the kernel choice for a run (module docstring): {"requested", "variant", "kernel", "pool_from",
    "source", "reason", "device_kind", "shape_class", and "ms" (per variant) when measured}.

    Args:
      embedding: the config's `embedding` section (recjax/sections.py `EmbeddingSection`: kernel, pool_from, dedup,
        kernel_cache, kernel_measure).
      collection: the run's collection built with kernel "xla" (its structure gives the shape class; a measurement
        builds one collection per variant from its specs).
      device: where the run executes (default: `current_device()`); measure: the timer of the variants (default:
        `measure_variants` on this device) -- both replaceable so the choice can be tested on a CPU.
    """
    requested, pool_from, dedup_mode, mode = (embedding.kernel, embedding.pool_from, embedding.dedup,
                                               embedding.kernel_measure)
    if requested not in KERNELS:
        raise ValueError(f"unknown kernel '{requested}'; use one of {KERNELS}")
    if mode not in KERNEL_MEASURE:
        raise ValueError(f"unknown kernel_measure '{mode}'; use one of {KERNEL_MEASURE}")
    record = {"requested": requested}
    if requested != "auto":
        return {**record, "variant": None, "kernel": requested, "pool_from": pool_from, "source": "config",
                "reason": f"embedding.kernel={requested!r}"}
    device = device or current_device()
    record.update(device_kind=device.kind)

    def chosen(variant: str, source: str, reason: str, **extra) -> dict:
        kernel, variant_pool_from = VARIANTS[variant]
        where = resolve_pool_from(variant_pool_from or pool_from, kernel, collection.lookup_cases())
        return {**record, "variant": variant, "kernel": kernel, "pool_from": where, "source": source,
                "reason": reason, **extra}

    if device.platform not in ("gpu", "tpu"):
        return chosen("xla", "platform", f"no Pallas kernels run on {device.platform}")
    klass = shape_class(collection, optimizer, batch_size, dedup_mode, pool_from)
    record.update(shape_class=klass)
    shipped = shipped_choice(device.kind, klass)
    if device.devices > 1:
        if shipped:
            return chosen(shipped[0], "shipped", shipped[1])
        return chosen("xla", "default", f"a run on {device.devices} devices: the choice is never measured there "
                                        "(set embedding.kernel to use the kernels)")
    path = cache_path(embedding.kernel_cache)
    key = f"{device.kind}|jax {jax.__version__}|{KERNELS_REVISION}|{klass}"
    if mode != "always":
        cached = read_cache(path).get(key) if path else None
        if cached and cached.get("variant") in VARIANTS:
            return chosen(cached["variant"], "cache", f"measured {cached.get('measured_at', '?')} ({path})",
                          ms=cached.get("ms"))
        if shipped:
            return chosen(shipped[0], "shipped", shipped[1])
        if mode == "never":
            return chosen("xla", "default", "embedding.kernel_measure='never' and no cached or shipped choice")
    variants = candidate_variants(collection, pool_from)
    need = table_bytes(collection, optimizer)
    if measure is None:
        if device.memory_bytes and need > MEASURE_MEMORY_FRACTION * device.memory_bytes:
            return chosen("xla", "default", f"not measured: the tables and optimizer state ({need / 2**30:.1f} GiB) "
                                            f"exceed {MEASURE_MEMORY_FRACTION:.0%} of the device's memory; set "
                                            "embedding.kernel to use the kernels")
        measure = lambda v: measure_variants(collection, optimizer, batch_size, dedup_mode, v)  # noqa: E731
    print(f"embedding.kernel=auto: timing the embedding stage with {', '.join(variants)} on {device.kind} for "
          f"{klass} (once per device kind and shape class; cached in {path or 'no file'})", flush=True)
    seconds = measure(variants)
    ms = {v: 1000 * s for v, s in seconds.items()}
    best = min((v for v in ms if v != "xla"), key=ms.get, default=None)
    variant = best if best is not None and ms[best] < (1 - MARGIN) * ms["xla"] else "xla"
    reason = (f"{variant} {ms[variant]:.3f} ms vs xla {ms['xla']:.3f} ms" if variant != "xla" else
              f"no kernel variant at least {MARGIN:.0%} faster than xla ({ms['xla']:.3f} ms): "
              + ", ".join(f"{v} {t:.3f} ms" for v, t in ms.items() if v != "xla"))
    print(f"embedding.kernel=auto: {variant} ({reason})", flush=True)
    if path:
        write_cache(path, key, {"variant": variant, "ms": ms, "shape_class": klass, "device_kind": device.kind,
                                "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")})
    return chosen(variant, "measured", reason, ms=ms)


def candidate_variants(collection: EmbeddingCollection, pool_from: str) -> dict[str, tuple[str, str | None]]:
    """The variants to time: XLA, and the kernels on each place to pool from that the config allows -- "table" only
    where the platform's kernels take every lookup (`resolve_pool_from`)."""
    variants = {"xla": VARIANTS["xla"]}
    for name, (kernel, where) in VARIANTS.items():
        if kernel == "xla" or pool_from not in ("auto", where):
            continue
        if where == "table" and pool_from == "auto" and resolve_pool_from("auto", kernel,
                                                                          collection.lookup_cases()) != "table":
            continue
        variants[name] = (kernel, where)
    return variants


def table_bytes(collection: EmbeddingCollection, optimizer: SparseOptimizer) -> int:
    """Bytes of the stacked tables and their sparse optimizer state."""
    return sum(4 * rows * collection.group_dims[g] + optimizer.state_bytes(rows, collection.group_dims[g])
               for g, rows in collection.group_rows.items())


def read_cache(path: pathlib.Path) -> dict:
    """The cache's choices {key: entry}; {} when the file is missing or unreadable (then said once on stdout)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        print(f"embedding.kernel_cache {path}: unreadable ({e}); ignoring it (it is rewritten after the next "
              "measurement; delete it or set embedding.kernel_cache to another file)", flush=True)
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("choices"),
                                                                                             dict):
        return {}
    return data["choices"]


def write_cache(path: pathlib.Path, key: str, entry: dict) -> None:
    """Add `entry` under `key`, atomically (a concurrent run reads the old file or the new one, never half)."""
    choices = {**read_cache(path), key: entry}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "choices": choices}, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        print(f"embedding.kernel_cache {path}: cannot write the measured choice ({e}); the next run measures again "
              "(set embedding.kernel_cache to a writable file, or 'none')", flush=True)


# ------------------------------------------------------------------------------------------- measurement
def measure_variants(collection: EmbeddingCollection, optimizer: SparseOptimizer, batch_size: int, dedup_mode: str,
                     variants: Mapping[str, tuple[str, str | None]], *, seed: int = 0, batches: int = 4,
                     **timing_kwargs) -> dict[str, float]:
    """Seconds per call of the embedding stage (module docstring) with each variant's kernel and pool_from, timed on
    the default device one variant after another (only one variant's tables are alive at a time), over `batches`
    batches of uniform ids with full bags (the loop cycles through them, so no call repeats its predecessor)."""
    ids, lengths = uniform_batches(collection.spec, batch_size, batches, seed)
    seconds = {}
    for name, (kernel, pool_from) in variants.items():
        variant = EmbeddingCollection(collection.spec, list(collection.table_specs.values()), collection.pooling,
                                      collection.bounds_check, kernel,
                                      resolve_dedup(dedup_mode, kernel, optimizer,
                                                    any(f.bag_size > 1 for f in collection.spec.features)),
                                      pool_from or "auto")
        body = embedding_stage(variant, optimizer, ids, lengths)
        carry = (variant.init_tables(jax.random.key(seed)), variant.init_optimizer(optimizer))
        seconds[name] = timing.seconds_per_call(body, carry, **timing_kwargs).seconds
        del carry
    return seconds


def uniform_batches(spec: DatasetSpec, batch_size: int, count: int, seed: int
                    ) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """`count` batches of uniform ids, full bags: ids {feature: i32[count, B, L]}, lengths {feature: i32[count, B]}."""
    keys = jax.random.split(jax.random.key(seed), len(spec.features))
    ids = {f.name: jax.random.randint(k, (count, batch_size, f.bag_size), 0, f.vocab_size, jnp.int32)
           for f, k in zip(spec.features, keys, strict=True)}
    lengths = {f.name: jnp.full((count, batch_size), f.bag_size, jnp.int32) for f in spec.features}
    return ids, lengths


def embedding_stage(collection: EmbeddingCollection, optimizer: SparseOptimizer, ids: Mapping[str, jax.Array],
                    lengths: Mapping[str, jax.Array], lr: float = 0.01) -> timing.Body:
    """body(i, (tables, optimizer state)) for `timing`: the training step's embedding half on batch i mod count --
    route, lookups (pooled from wherever the variant pools), their backward from a fixed cotangent, sparse update."""
    count = next(iter(ids.values())).shape[0]
    aux = collection.init_aux()

    def body(i, carry):
        tables, state = carry
        batch_ids = {f: x[i % count] for f, x in ids.items()}
        batch_lengths = {f: x[i % count] for f, x in lengths.items()}
        routes = collection.route(batch_ids, batch_lengths, aux=aux)
        rows = collection.gather(tables, routes)
        looked, vjp = jax.vjp(lambda r: r if isinstance(r, Lookups) else collection.lookup(r, routes.features), rows)
        (row_grads,) = vjp(jax.tree.map(lambda x: jnp.full_like(x, 1e-3), looked))
        return collection.sparse_update(optimizer, tables, state, routes, rows, row_grads, jnp.float32(lr), i + 1)

    return body


def describe(choice: Mapping) -> str:
    """One line for a run's log."""
    where = f" on {choice['device_kind']}" if choice.get("device_kind") else ""
    return (f"embedding.kernel={choice['requested']}: {choice['kernel']} (pool_from {choice['pool_from']}){where}, "
            f"{choice['source']}: {choice['reason']}")

