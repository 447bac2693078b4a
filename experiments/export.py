r"""Export a trained run as a self-contained serving model.

    python -m experiments.export --workdir=runs/ml100k --out=runs/ml100k/export                  # f32 tables
    python -m experiments.export --workdir=runs/ml100k --quantize=int8 --out=runs/ml100k/export_int8
    python -m experiments.export --workdir=runs/kaggle --quantize=int4 --platforms=cpu,cuda --out=DIR

--quantize: f32 (default), fp16, bf16, int8, int4 (row-wise, FBGEMM's fused rows; recjax/serving/tables.py).
The export (layout in recjax/serving/loader.py) is read with jax + numpy only: `python -m experiments.serve --model=DIR`
serves it over HTTP, and DIR/serving_loader.py loads it in any Python with jax. A run whose data are real files
re-reads them to write the input spec (vocabularies, per-user / per-movie tables), so --workdir's data.dir must
still hold them.

The export is built beside --out and swapped in whole (recjax/serving/export.py): a server starting meanwhile, or a
kill at any moment, finds the old export or the new one, complete. An export already at --out is replaced only with
--overwrite.
"""

from absl import flags

from recjax import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir (python -m experiments.train --workdir).")
_OUT = flags.DEFINE_string("out", None, "Where to write the export: a new directory (or an export to replace, with "
                           "--overwrite).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace the export already at --out (swapped in whole once the new "
                               "one is written).")
_QUANTIZE = flags.DEFINE_string("quantize", "f32", "Table format: f32, fp16, bf16, int8 or int4.")
_PLATFORMS = flags.DEFINE_list("platforms", ["cpu"], "Platforms to lower for: cpu (always useful), cuda, rocm, tpu.")
_STEP = flags.DEFINE_integer("step", None, "Export this checkpointed step instead of the run's selected step (the "
                             "one summary.json reports).")


def main(argv):
    if len(argv) > 1:
        cli.fail(f"unexpected arguments: {argv[1:]}")
    if not _WORKDIR.value or not _OUT.value:
        cli.fail("--workdir and --out are required, e.g. --workdir=runs/ml100k --out=runs/ml100k/export")
    from recjax.serving.export import check_out, export_run, load_run

    check_out(_OUT.value, _OVERWRITE.value)  # before the run is restored: a wrong --out fails at once
    export_run(load_run(_WORKDIR.value, _STEP.value), _OUT.value, _QUANTIZE.value, _PLATFORMS.value,
               overwrite=_OVERWRITE.value)


if __name__ == "__main__":
    cli.run(main)
