"""embedding.kernel="auto": chosen by measurement per device kind and step shape, never slower than XLA, cached, and
reported in the run's summary -- the measurement path forced on this CPU with fake devices and fake timings; the real
timer and embedding stage run here too (the kernels interpreted), against an SGD oracle."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train import tiny_config

from pallas_kernels import timing
from recjax import kernel_choice
from recjax.embedding import EmbeddingCollection, resolve_dedup
from recjax.errors import ConfigError
from recjax.kernel_choice import Device, choose_kernel, shape_class
from recjax.sections import EmbeddingSection
from recjax.sparse_optim import SGD, LazyAdam, RowwiseAdagrad
from recjax.specs import DatasetSpec, FeatureSpec
from recjax.task import build_task, table_specs

SPEC = DatasetSpec(num_dense=3, features=(FeatureSpec("a", 1000), FeatureSpec("b", 90, bag_size=4),
                                          FeatureSpec("c", 3000, bag_size=4)))
GPU = Device("gpu", "Fake GPU 80GB", devices=1, memory_bytes=80 << 30)


def probe(spec=SPEC, dim=8):
    config = tiny_config()
    config.embedding.dim = dim
    return EmbeddingCollection(spec, table_specs(spec, config), kernel="xla")


class FakeTimer:
    """Seconds per variant, and the variants each call was asked to time."""

    def __init__(self, **seconds):
        self.seconds, self.calls = seconds, []

    def __call__(self, variants):
        self.calls.append(dict(variants))
        return {name: self.seconds[name] for name in variants}


def embedding(tmp_path, **keys):
    """The `embedding` section as the runtime reads it (recjax/sections.py), its defaults but the kernel cache."""
    return EmbeddingSection(dim=8, **{"kernel_cache": str(tmp_path / "choices.json"), **keys})


def test_shape_class_names_what_the_timing_depends_on():
    """Optimizer (and decay), batch, and per group: lookup kind, dim, rows to a power of two, reads per bag size."""
    assert shape_class(probe(), SGD(0.1), 256) == "sgd/b256/reduce:d8:r2^12:L1x1,reduce:d8:r2^12:L4x2"
    assert (shape_class(probe(dim=16), RowwiseAdagrad(0.1, weight_decay=1e-5), 2048, "always", "table")
            == "rowwise_adagrad+wd/b2048/reduce:d16:r2^12:L1x1,reduce:d16:r2^12:L4x2/dedup=always/pool_from=table")


def test_measured_once_then_cached_and_never_slower_than_xla(tmp_path, capsys):
    """The first run of a shape on a device kind times XLA and each kernel variant and takes the fastest only when it
    beats XLA by the margin; the choice goes to the cache, which the next run reads without timing anything."""
    collection, optimizer = probe(), LazyAdam(0.01)
    timer = FakeTimer(xla=1.0e-3, pallas_distinct_rows=0.97e-3, pallas_table=0.80e-3)
    first = choose_kernel(embedding(tmp_path), collection, optimizer, 256, device=GPU, measure=timer)
    assert timer.calls == [{"xla": ("xla", None), "pallas_distinct_rows": ("pallas", "distinct_rows"),
                            "pallas_table": ("pallas", "table")}]
    assert (first["variant"], first["kernel"], first["pool_from"], first["source"]) == (
        "pallas_table", "pallas", "table", "measured")
    assert first["ms"] == pytest.approx({"xla": 1.0, "pallas_distinct_rows": 0.97, "pallas_table": 0.8})
    assert "timing the embedding stage" in capsys.readouterr().out
    cache = json.loads((tmp_path / "choices.json").read_text())
    (key, entry), = cache["choices"].items()
    assert key.startswith("Fake GPU 80GB|jax ") and key.endswith(shape_class(collection, optimizer, 256))
    assert entry["variant"] == "pallas_table"

    again = choose_kernel(embedding(tmp_path), collection, optimizer, 256, device=GPU, measure=FakeTimer())
    assert (again["variant"], again["source"]) == ("pallas_table", "cache") and again["ms"] == first["ms"]
    # Another batch is another shape class: measured; a kernel only 3 % faster than XLA is not taken.
    close = FakeTimer(xla=1.0e-3, pallas_distinct_rows=0.99e-3, pallas_table=0.97e-3)
    other = choose_kernel(embedding(tmp_path), collection, optimizer, 512, device=GPU, measure=close)
    assert (other["variant"], other["kernel"], other["source"]) == ("xla", "xla", "measured") and close.calls
    # "always" measures again (and rewrites the entry); "never" uses what is there.
    slower = FakeTimer(xla=1.0e-3, pallas_distinct_rows=2e-3, pallas_table=2e-3)
    redone = choose_kernel(embedding(tmp_path, kernel_measure="always"), collection, optimizer, 256, device=GPU,
                           measure=slower)
    assert (redone["variant"], redone["source"]) == ("xla", "measured")
    kept = choose_kernel(embedding(tmp_path, kernel_measure="never"), collection, optimizer, 256, device=GPU,
                         measure=FakeTimer())
    assert (kept["variant"], kept["source"]) == ("xla", "cache")


def test_shipped_table_mesh_runs_never_and_memory(tmp_path):
    collection, optimizer = probe(), SGD(0.1)
    # The H200 measured slower with the kernels (issue 41): XLA without timing anything, unless asked to measure.
    h200 = Device("gpu", "NVIDIA H200", 1, 141 << 30)
    shipped = choose_kernel(embedding(tmp_path), collection, optimizer, 256, device=h200, measure=FakeTimer())
    assert (shipped["kernel"], shipped["source"]) == ("xla", "shipped") and "issue 41" in shipped["reason"]
    for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe"):
        assert choose_kernel(embedding(tmp_path), collection, optimizer, 256, device=Device("gpu", kind, 1, None),
                             measure=FakeTimer())["source"] == "shipped"
    timer = FakeTimer(xla=1e-3, pallas_distinct_rows=0.5e-3, pallas_table=0.6e-3)
    forced = choose_kernel(embedding(tmp_path, kernel_measure="always"), collection, optimizer, 256, device=h200,
                           measure=timer)
    assert (forced["variant"], forced["source"]) == ("pallas_distinct_rows", "measured")
    # Several devices: no measurement and no cache (every process must run the same program): shipped, else XLA.
    mesh = choose_kernel(embedding(tmp_path), collection, optimizer, 256,
                         device=Device("gpu", "Fake GPU 80GB", 8, 80 << 30), measure=FakeTimer())
    assert (mesh["kernel"], mesh["source"]) == ("xla", "default") and "8 devices" in mesh["reason"]
    assert choose_kernel(embedding(tmp_path), collection, optimizer, 256, device=Device("gpu", "NVIDIA H200", 8, None),
                         measure=FakeTimer())["source"] == "shipped"
    never = choose_kernel(embedding(tmp_path, kernel_measure="never"), collection, optimizer, 256, device=GPU,
                          measure=FakeTimer())
    assert (never["kernel"], never["source"]) == ("xla", "default")
    # Tables too large to measure beside nothing else: XLA, saying why (the real timer would have run).
    small = Device("gpu", "Fake GPU 80GB", 1, memory_bytes=1 << 10)
    big = choose_kernel(embedding(tmp_path), collection, optimizer, 256, device=small)
    assert (big["kernel"], big["source"]) == ("xla", "default") and "device's memory" in big["reason"]


def test_cpu_config_and_a_broken_cache(tmp_path, capsys):
    collection, optimizer = probe(), SGD(0.1)
    cpu = choose_kernel(embedding(tmp_path), collection, optimizer, 256, device=Device("cpu", "cpu", 1, None),
                        measure=FakeTimer())
    assert (cpu["kernel"], cpu["source"]) == ("xla", "platform")
    named = choose_kernel(embedding(tmp_path, kernel="pallas_gpu"), collection, optimizer, 256, device=GPU)
    assert (named["kernel"], named["source"], named["pool_from"]) == ("pallas_gpu", "config", "auto")
    assert not (tmp_path / "choices.json").exists()
    (tmp_path / "choices.json").write_text("{not json")
    timer = FakeTimer(xla=1e-3, pallas_distinct_rows=2e-3, pallas_table=2e-3)
    chosen = choose_kernel(embedding(tmp_path), collection, optimizer, 256, device=GPU, measure=timer)
    assert chosen["source"] == "measured" and "unreadable" in capsys.readouterr().out
    assert json.loads((tmp_path / "choices.json").read_text())["version"] == kernel_choice.CACHE_VERSION
    # pool_from fixed by the config: only that variant of the kernels is timed.
    timer = FakeTimer(xla=1e-3, pallas_table=0.5e-3)
    fixed = choose_kernel(embedding(tmp_path, pool_from="table", kernel_cache="none"), collection, optimizer, 256,
                          device=GPU, measure=timer)
    assert list(timer.calls[0]) == ["xla", "pallas_table"] and fixed["pool_from"] == "table"


def test_build_task_uses_the_choice_and_validates_the_keys(tmp_path, monkeypatch):
    """build_task builds the collection with the chosen kernel and pool_from (its dedup resolved for that kernel) and
    records the choice; on this CPU "auto" is the XLA path. Bad values of the new keys are ConfigErrors."""
    from recjax.config_check import validate_config

    config = tiny_config()
    config.embedding.kernel_cache = str(tmp_path / "choices.json")
    spec = DatasetSpec(3, (FeatureSpec("a", 50), FeatureSpec("b", 40, bag_size=3)))
    task = build_task(config, spec)
    assert task.collection.kernel == "xla" and task.collection.kernel_choice == {
        "requested": "auto", "device_kind": jax.devices()[0].device_kind, "variant": "xla", "kernel": "xla",
        "pool_from": "distinct_rows", "source": "platform", "reason": "no Pallas kernels run on cpu",
        "dedup": task.collection.dedup}
    monkeypatch.setattr(kernel_choice, "current_device", lambda: GPU)
    monkeypatch.setattr(kernel_choice, "measure_variants", lambda *a, **k: {"xla": 2e-3, "pallas_distinct_rows": 3e-3,
                                                                            "pallas_table": 1e-3})
    task = build_task(config, spec)
    assert (task.collection.kernel, task.collection.pool_from, task.collection.dedup) == ("pallas", "table", True)
    assert task.collection.kernel_choice["source"] == "measured"
    for key, value, message in (("kernel_measure", "sometimes", "use one of"), ("kernel_cache", None, "string")):
        bad = tiny_config()
        bad.embedding[key] = value
        with pytest.raises(ConfigError, match=f"embedding.{key}: .*{message}"):
            validate_config(bad)


def test_timing_runs_each_call_in_a_loop_per_host_sync():
    """Every call of the body runs -- its carry counts them: two warm-up calls, one calibration loop, then the timed
    loops of `iterations` calls per host sync each -- and the loop index reaches the body. (A target no loop reaches
    makes the iterations the cap: deterministic.)"""
    def body(i, carry):
        calls, index_sum = carry
        return calls + 1, index_sum + i

    timings, carries = timing.compare({"count": (body, (jnp.int32(0), jnp.int32(0)))}, repeats=3, min_seconds=1e9,
                                      max_iterations=16)
    t = timings["count"]
    assert t.iterations == 16 and len(t.repeats) == 3 and t.seconds == np.median(t.repeats) > 0
    assert int(carries["count"][0]) == 2 + 1 + 3 * 16
    assert int(carries["count"][1]) == 3 * sum(range(16))
    rate, copy = timing.copy_bandwidth(1 << 16, repeats=1, min_seconds=1e9, max_iterations=4)
    assert copy.iterations == 4 and rate == pytest.approx(2 * (1 << 16) / copy.seconds)


@pytest.mark.parametrize("variants", [
    ("xla",), pytest.param(("pallas_distinct_rows", "pallas_table"), marks=pytest.mark.slow)])
def test_the_measured_stage_is_the_embedding_step(variants):
    """The stage `auto` times is a real training step's embedding half: with SGD, sum pooling and the fixed
    cotangent c, every variant moves each row by -lr * c * (its occurrences in the batch) -- a numpy count is the
    oracle -- and `measure_variants` times it (the kernels interpreted on this CPU)."""
    spec = DatasetSpec(3, (FeatureSpec("a", 30), FeatureSpec("b", 20, bag_size=3)))
    collection = probe(spec)
    optimizer = SGD(0.5)
    ids, lengths = kernel_choice.uniform_batches(spec, 8, 2, seed=3)
    for name in variants:
        kernel, pool_from = kernel_choice.VARIANTS[name]
        variant = EmbeddingCollection(spec, list(collection.table_specs.values()), kernel=kernel,
                                      dedup=resolve_dedup("auto", kernel, optimizer), pool_from=pool_from or "auto")
        tables = variant.init_tables(jax.random.key(0))
        body = jax.jit(kernel_choice.embedding_stage(variant, optimizer, ids, lengths, lr=0.5))
        new_tables, _ = body(jnp.int32(1), (tables, variant.init_optimizer(optimizer)))
        (group,) = tables
        counts = np.zeros(variant.group_rows[group])
        offsets = {p.feature: p.offset for p in variant.physical_tables()}
        for f in spec.feature_names:
            np.add.at(counts, np.asarray(ids[f][1]).reshape(-1) + offsets[f], 1)
        want = np.asarray(tables[group]) - 0.5 * 1e-3 * counts[:, None]
        np.testing.assert_allclose(np.asarray(new_tables[group]), want, rtol=1e-6, atol=1e-7)
    seconds = kernel_choice.measure_variants(collection, optimizer, 8, "auto",
                                             {n: kernel_choice.VARIANTS[n] for n in variants}, batches=2, repeats=1,
                                             min_seconds=1e-3, max_iterations=2)
    assert set(seconds) == set(variants) and all(np.isfinite(s) and s > 0 for s in seconds.values())


def test_hbm_spec_by_device_kind():
    """NVIDIA's data-sheet bandwidth by device kind (as jax names the devices); TPUs from jax's chip info (a v5e is
    819 GB/s, a v4 1.2 TB/s by Google's spec); none for a CPU or an unknown GPU."""
    import types

    from pallas_kernels.hardware import for_tpu_chip, hbm_spec_bytes_per_second

    def spec(platform, kind):
        return hbm_spec_bytes_per_second(types.SimpleNamespace(platform=platform, device_kind=kind))[0]

    for kind, rate in (("NVIDIA H200", 4.8e12), ("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H100 PCIe", 2.0e12),
                       ("NVIDIA H100 NVL", 3.9e12), ("NVIDIA A100-SXM4-80GB", 2.039e12),
                       ("NVIDIA A100 80GB PCIe", 1.935e12), ("NVIDIA A100-SXM4-40GB", 1.555e12)):
        assert spec("gpu", kind) == rate, kind
    assert spec("gpu", "NVIDIA GH200 480GB") is None and spec("gpu", "NVIDIA L4") is None
    assert hbm_spec_bytes_per_second(jax.devices()[0]) == (None, "no HBM on a cpu device")
    with for_tpu_chip("TPU v5 lite"):
        assert spec("tpu", "TPU v5 lite") == pytest.approx(819e9, rel=0.01)
    with for_tpu_chip("TPU v4", num_cores=2):
        assert spec("tpu", "TPU v4") == pytest.approx(1.2e12, rel=0.03)
