"""Every config mistake is a ConfigError naming its key, found before any work; the launcher prints it as one line
and exits with status 2."""

import copy
import os
import pathlib
import subprocess
import sys

import pytest

from experiments.configs import (
    common,
    dcnv2_synthetic,
    dlrm_criteo_kaggle,
    dlrm_movielens,
    dlrm_synthetic,
    fm_movielens,
    lr_movielens,
    mf_movielens,
    scaling,
    wukong_synthetic,
)
from recjax.config_check import validate_config
from recjax.errors import ConfigError
from recjax.models import MODELS, embedding_dim, make_model

REPO = pathlib.Path(__file__).resolve().parents[1]


def synthetic():
    return dlrm_synthetic.get_config()


def movielens(tmp_path):
    config = dlrm_movielens.get_config()
    directory = tmp_path / "ml"
    directory.mkdir(exist_ok=True)
    for name in ("u.data", "u.user", "u.item"):
        (directory / name).write_text("")
    config.data.dir = str(directory)
    return config


# (config factory, dotted key, bad value, key the message must name, text it must contain)
BAD = [
    ("synthetic", "train.steps", 0, "train.steps", ">= 1, got 0"),
    ("synthetic", "train.steps", -5, "train.steps", ">= 1, got -5"),
    ("synthetic", "train.steps", 2.5, "train.steps", "whole number"),
    ("synthetic", "train.steps", "abc", "train.steps", "whole number"),
    ("synthetic", "train.batch_size", 0, "train.batch_size", ">= 1, got 0"),
    ("synthetic", "train.batch_size", -8, "train.batch_size", ">= 1, got -8"),
    ("synthetic", "train.eval_every", 0, "train.eval_every", ">= 1 steps or 'epoch'"),
    ("synthetic", "train.eval_every", "weekly", "train.eval_every", "'0.25epoch'"),
    ("synthetic", "train.eval_every", "epoch", "train.eval_every", "synthetic data is an endless stream"),
    ("synthetic", "train.epochs", 3, "train.steps", "exactly one of train.steps and train.epochs"),
    ("synthetic", "train.log_every", 0, "train.log_every", ">= 1"),
    ("synthetic", "train.early_stopping_patience", -1, "train.early_stopping_patience", ">= 0"),
    ("synthetic", "train.select_on", "accuracy", "train.select_on", "'auc', 'logloss'"),
    ("synthetic", "train.selection_logloss_tolerance", -0.01, "train.selection_logloss_tolerance", ">= 0"),
    ("synthetic", "train.selection_auc_tolerance", float("inf"), "train.selection_auc_tolerance", "finite number"),
    ("synthetic", "train.divergence_factor", 1.0, "train.divergence_factor", "must be 0 (off) or > 1"),
    ("synthetic", "train.divergence_factor", -2.0, "train.divergence_factor", ">= 0"),
    ("synthetic", "optimizer.dense.learning_rate", -0.1, "optimizer.dense.learning_rate", "> 0"),
    ("synthetic", "optimizer.dense.learning_rate", 0.0, "optimizer.dense.learning_rate", "> 0"),
    ("synthetic", "optimizer.sparse.learning_rate", float("nan"), "optimizer.sparse.learning_rate", "finite"),
    ("synthetic", "optimizer.dense.name", "rmsprop", "optimizer.dense.name", "'sgd', 'adam', 'adagrad'"),
    ("synthetic", "optimizer.sparse.name", "adamax", "optimizer.sparse.name", "lazy_adam"),
    ("synthetic", "optimizer.sparse.weight_decay", -1e-4, "optimizer.sparse.weight_decay", ">= 0"),
    ("synthetic", "optimizer.dense.weight_decay", -1.0, "optimizer.dense.weight_decay", ">= 0"),
    ("synthetic", "optimizer.decay", "linear", "optimizer.decay", "'none', 'cosine'"),
    ("synthetic", "optimizer.warmup_steps", -1, "optimizer.warmup_steps", ">= 0"),
    ("synthetic", "embedding.dim", 0, "embedding.dim", ">= 1"),
    ("synthetic", "embedding.method", "pq", "embedding.method", "'qr'"),
    ("synthetic", "embedding.pooling", "max", "embedding.pooling", "'sum', 'mean'"),
    ("synthetic", "model.name", "transformer", "model.name", "'dlrm', 'dcnv2', 'wukong', 'lr', 'fm'"),
    ("synthetic", "model.tuned_for", "svm", "model.tuned_for", "'dlrm', 'dcnv2', 'wukong', 'lr', 'fm'"),
    ("synthetic", "model.dlrm.bottom_mlp", (64, 8), "model.dlrm.bottom_mlp", "equal embedding.dim (16)"),
    ("synthetic", "model.dlrm.top_mlp", (64, 2), "model.dlrm.top_mlp", "must end in 1"),
    ("synthetic", "model.dlrm.top_mlp", (64, 0, 1), "model.dlrm.top_mlp", "widths >= 1"),
    ("synthetic", "model.dlrm.interaction", "attention", "model.dlrm.interaction", "'dot', 'cat'"),
    ("synthetic", "model.dlrm.dropout", 1.0, "model.dlrm.dropout", "< 1"),
    ("synthetic", "data.bag_sizes", (1, 2), "data.bag_sizes", "one bag size >= 1 per feature (26 features"),
    ("synthetic", "data.vocab_sizes", (), "data.vocab_sizes", "non-empty"),
    ("synthetic", "data.eval_examples", 0, "data.eval_examples", ">= 1"),
    ("synthetic", "data.name", "imagenet", "data.name", "'synthetic', 'movielens'"),
    ("synthetic", "seed", -1, "seed", ">= 0"),
    ("movielens", "data.split.test_fraction", 1.5, "data.split.test_fraction", "< 1"),
    ("movielens", "data.split.validation_fraction", 0.95, "data.split.test_fraction",
     "validation_fraction + test_fraction must be < 1"),
    ("movielens", "data.split.method", "weekly", "data.split.method", "'random', 'time'"),
    ("movielens", "data.dir", "/nonexistent/ml-100k", "data.dir", "does not exist"),
    ("movielens", "data.zip_prefix_length", 0, "data.zip_prefix_length", ">= 1"),
    ("movielens", "train.eval_every", "0epoch", "train.eval_every", "'0.25epoch'"),
    ("movielens", "train.epochs", -1.0, "train.epochs", "> 0"),
]


@pytest.mark.parametrize("factory, key, value, named, text", BAD, ids=[f"{k}={v!r}" for _, k, v, _, _ in BAD])
def test_each_bad_value_is_a_config_error_naming_its_key(tmp_path, factory, key, value, named, text):
    config = synthetic() if factory == "synthetic" else movielens(tmp_path)
    node = config
    *parents, leaf = key.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = value
    with pytest.raises(ConfigError) as error:
        validate_config(config)
    assert error.value.key == named and str(error.value).startswith(f"{named}: "), str(error.value)
    assert text in str(error.value), str(error.value)


def test_typed_sections_take_their_defaults_and_name_bad_keys():
    """recjax/sections.py: a config without its optional sections (mesh, sharding, tiering), or a section without one
    of its keys, runs with the dataclasses' defaults -- the ones experiments/configs/common.py builds its sections
    from, so nothing downstream repeats them; a value of the wrong type or a key the section lacks is a one-line
    ConfigError naming the dotted key."""
    import ml_collections

    from recjax.sections import MeshSection, ShardingSection, TieringSection, read_sections

    config = synthetic()
    assert read_sections(config).tiering == TieringSection() and read_sections(config).sharding == ShardingSection()
    with config.unlocked():
        del config["tiering"]
        del config["mesh"]
        del config.sharding["capacity_sigmas"]
    sections = validate_config(config)
    assert sections.tiering == TieringSection() and sections.mesh == MeshSection()
    assert sections.sharding.capacity_sigmas == ShardingSection().capacity_sigmas == 7.0
    for section, fields, key, text in [
        ("tiering", {"cache_rows": "many"}, "tiering.cache_rows", "must be a whole number, got 'many'"),
        ("tiering", {"prefetch": 1}, "tiering.prefetch", "must be True or False, got 1"),
        ("sharding", {"capacity_factor": "big"}, "sharding.capacity_factor", "must be a number, got 'big'"),
        ("tiering", {"cache_size": 3}, "tiering.cache_size", "is not a known field; tiering has ["),
        ("mesh", {"shape": 4}, "mesh.shape", "must be a string"),
    ]:
        config = synthetic()
        with config.unlocked():
            config[section] = ml_collections.ConfigDict(fields)
        with pytest.raises(ConfigError) as error:
            validate_config(config)
        assert error.value.key == key and str(error.value).startswith(f"{key}: ") and text in str(error.value), \
            str(error.value)


def test_unknown_fields_and_missing_files_are_named(tmp_path):
    config = synthetic()
    config.train.stepz = 10
    with pytest.raises(ConfigError, match=r"^train.stepz: is not a known field"):
        validate_config(config)
    config = synthetic()
    config.optimizer.sparse.momentum = 0.9
    with pytest.raises(ConfigError, match=r"^optimizer.sparse.momentum: is not a known field; .*'b1'"):
        validate_config(config)
    config = synthetic()
    config.model.dlrm.heads = 4
    with pytest.raises(ConfigError, match=r"^model.dlrm.heads: is not a known field"):
        validate_config(config)
    config = movielens(tmp_path)
    (pathlib.Path(config.data.dir) / "u.item").unlink()
    with pytest.raises(ConfigError, match=r"^data.dir: .*lacks u.item of the 100k variant"):
        validate_config(config)
    config = dlrm_criteo_kaggle.get_config()
    config.data.dir = str(tmp_path)
    with pytest.raises(ConfigError, match=r"^data.dir: .*train.txt not found"):
        validate_config(config)
    config.data.dir = ""
    with pytest.raises(ConfigError, match=r"^data.dir: set --config.data.dir"):
        validate_config(config)
    config.data.vocab = "hash"
    with pytest.raises(ConfigError, match=r"^data.max_index: vocab='hash' needs 1 <= max_index"):
        validate_config(config)


def test_fm_needs_room_for_a_factor():
    config = synthetic()
    config.model.name = "fm"
    config.embedding.dim = 1
    config.model.dlrm.bottom_mlp = (64, 1)
    with pytest.raises(ConfigError, match=r"^embedding.dim: fm needs embedding.dim >= 2"):
        validate_config(config)


def test_every_shipped_config_and_every_model_swap_validates(tmp_path):
    configs = [dlrm_synthetic.get_config(p) for p in ("small", "kaggle", "terabyte", "mlperf")]
    configs += [wukong_synthetic.get_config(), dcnv2_synthetic.get_config(), scaling.get_config("dcnv2,5")]
    for module in (dlrm_movielens, lr_movielens, fm_movielens, mf_movielens):
        config = module.get_config()
        config.data.dir = movielens(tmp_path).data.dir
        configs.append(config)
    checked = 0
    for config in configs:
        validate_config(config)
        for name in ("dlrm", "dcnv2", "wukong", "lr", "fm", "mf"):
            swapped = copy.deepcopy(config)
            common.swap_model(swapped, name, {"model.name"})
            validate_config(swapped)
            # What passed validation also builds: the family's module from its own sub-config.
            model = make_model(swapped.model, embedding_dim(swapped))
            assert isinstance(model, MODELS[name]), (name, type(model))
            assert name != "fm" or model.factor_dim == swapped.embedding.dim - 1
            checked += 1
    # Every swap, DLRM on fm_movielens too: the swap brings DLRM's 16-wide embeddings back for its dot interaction.
    assert checked == 6 * len(configs)


def test_a_model_swap_brings_the_values_the_config_tuned_for_that_family():
    """dlrm_movielens.py tunes a row L2 of 3e-3 for DLRM; logistic regression lost ~0.045 AUC keeping it. A swap now
    brings the values the config tuned for the new family (the hand-written values lr_movielens.py used to set),
    explicit values win, a swap back restores the original, and a family without tuned values gets a WARNING naming
    what it inherits."""
    config = dlrm_movielens.get_config()
    config.optimizer.sparse.learning_rate = 0.05  # as if given on the command line
    lines = common.swap_model(config, "lr", {"model.name", "optimizer.sparse.learning_rate"})
    assert (config.model.name, config.model.tuned_for) == ("lr", "lr")
    assert config.optimizer.sparse.weight_decay == 0.0 and config.optimizer.dense.learning_rate == 0.01
    assert config.train.batch_size == 256 and config.train.epochs == 20
    assert config.optimizer.sparse.learning_rate == 0.05  # explicit: kept
    assert config.optimizer.dense.weight_decay == 0.0 and config.optimizer.sparse.name == "adagrad"  # untouched
    assert lines == ["model.name=lr: this config's lr defaults replace those it tuned for dlrm (config.model_defaults"
                     ".lr): optimizer.dense.learning_rate 0.003 -> 0.01, optimizer.sparse.weight_decay 0.003 -> 0.0, "
                     "train.batch_size 512 -> 256, train.epochs 10 -> 20; kept as set explicitly: "
                     "optimizer.sparse.learning_rate=0.05"]

    fm = dlrm_movielens.get_config()
    common.swap_model(fm, "fm", {"model.name"})
    assert (fm.embedding.dim, fm.optimizer.sparse.weight_decay, fm.train.batch_size, fm.train.epochs) == (
        9, 1e-3, 256, 10)
    assert fm.to_dict() == fm_movielens.get_config().to_dict()
    # lr_movielens.py swapped to DLRM is dlrm_movielens.py again, every value; fm's 9-wide embeddings go back to 16.
    for module in (lr_movielens, fm_movielens):
        back = module.get_config()
        common.swap_model(back, "dlrm", {"model.name"})
        assert back.to_dict() == dlrm_movielens.get_config().to_dict(), module.__name__
    unchanged = dlrm_movielens.get_config()
    assert common.swap_model(unchanged, "dlrm", {"model.name"}) == []  # its own family: nothing to do
    assert unchanged.to_dict() == dlrm_movielens.get_config().to_dict()

    wukong = dlrm_movielens.get_config()
    [warning] = common.swap_model(wukong, "wukong", {"model.name", "train.batch_size"})
    assert warning.startswith("WARNING: model.name=wukong: this config's learning rates and regularisation were "
                              "tuned for dlrm and it has no wukong defaults (config.model_defaults), so wukong trains "
                              "with dlrm's optimizer.dense.learning_rate=0.003, optimizer.dense.weight_decay=0.0, "
                              "optimizer.sparse.learning_rate=0.1, optimizer.sparse.weight_decay=0.003, "
                              "embedding.dim=16, train.epochs=10;"), warning  # batch_size: explicit, not listed
    assert (wukong.model.tuned_for, wukong.optimizer.sparse.weight_decay) == ("dlrm", 3e-3)
    [warning] = common.swap_model(dlrm_synthetic.get_config(), "lr", {"model.name"})
    assert "tuned for dlrm" in warning and "optimizer.sparse.learning_rate=0.003" in warning


def test_model_defaults_must_name_families_and_keys_the_config_has(tmp_path):
    config = movielens(tmp_path)
    config.model_defaults.lr.optimizer.sparse.momentum = 0.9
    with pytest.raises(ConfigError, match=r"^model_defaults.lr.optimizer.sparse.momentum: sets optimizer.sparse."
                                          r"momentum, which the config does not have"):
        validate_config(config)
    config = movielens(tmp_path)
    config.model_defaults.svm = {"optimizer": {"sparse": {"weight_decay": 0.0}}}
    with pytest.raises(ConfigError, match=r"^model_defaults.svm: is not a model family"):
        validate_config(config)


# ------------------------------------------------------------------------------------------------- the CLI
def launch(*args, cwd=REPO):  # ~3 s idle (imports only; no training in these cases)
    return subprocess.run([sys.executable, "-m", "experiments.train", *args], capture_output=True, text=True, cwd=cwd)


@pytest.mark.parametrize("args, message", [
    (["--config.train.stepz=10"], "error: --config.train.stepz: the config has no field 'stepz'; did you mean "
                                  "\"steps\" instead of \"stepz\"?"),
    (["--config=experiments/configs/nope.py"], "error: --config: config file experiments/configs/nope.py not found"),
    (["--config.train.steps=0"], "error: train.steps: must be >= 1, got 0"),
    # The same path as steps=0 above (validate_config's ConfigError, printed by the launcher), each message checked
    # in-process by test_each_bad_value_is_a_config_error_naming_its_key: a launcher process each is slow.
    pytest.param(["--config.train.batch_size=-8"], "error: train.batch_size: must be >= 1, got -8",
                 marks=pytest.mark.slow),
    pytest.param(["--config.train.eval_every=0"], "error: train.eval_every: must be >= 1 steps or 'epoch', got 0",
                 marks=pytest.mark.slow),
    (["--config=experiments/configs/dlrm_movielens.py", "--config.data.dir=/nonexistent"],
     "error: data.dir: /nonexistent does not exist."),
    (["--config=experiments/configs/dlrm_synthetic.py:huge"], "error: --config=experiments/configs/dlrm_synthetic.py"
                                                              ":huge: the config file failed: ValueError: unknown "
                                                              "preset 'huge'"),
    # A data flag without --config: the default config is synthetic; the message names the configs that read files.
    (["--config.data.dir=/data/ml-100k"], "error: --config.data.dir: the config has no field 'dir'; the default "
                                          "config (experiments/configs/dlrm_synthetic.py, used without --config) has "
                                          "no data.dir (data.name='synthetic': generated, no files to read); the "
                                          "configs with data.dir: experiments/configs/dlrm_criteo_kaggle.py, "
                                          "experiments/configs/dlrm_criteo_terabyte.py, experiments/configs/"
                                          "dlrm_csv_clicks.py, experiments/configs/dlrm_libfm.py, experiments/configs/"
                                          "dlrm_movielens.py, experiments/configs/fm_movielens.py, experiments/configs/"
                                          "lr_movielens.py, experiments/configs/mf_movielens.py (e.g. "
                                          "--config=experiments/configs/dlrm_criteo_kaggle.py)"),
    # A workdir that cannot be a directory (a virtual file system; below a file): one line, not an OSError traceback.
    (["--workdir=/proc/recjax_run"], "error: --workdir: cannot use /proc/recjax_run as a directory: "),
    # A list flag given twice: ml_collections joined the two lists (top_mlp (64, 1, 32, 1)); now an error.
    (["--config.model.dlrm.top_mlp=64,1", "--config.model.dlrm.top_mlp=32,1"],
     "error: --config.model.dlrm.top_mlp is given twice (64,1 and 32,1); give the whole list once, comma-separated: "
     "--config.model.dlrm.top_mlp=32,1"),
])
def test_launcher_prints_one_line_and_exits_2(args, message, tmp_path):
    result = launch(f"--workdir={tmp_path / 'run'}", *args)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[0].startswith(message), result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert len(lines) <= 8, result.stderr  # the message (data.dir errors add the download instructions)


def test_launcher_swaps_the_model_with_its_tuned_values_and_keeps_the_command_lines(tmp_path):
    """`--config.model.name=lr` on dlrm_movielens.py: the launcher prints what the swap changed, and config.json (the
    resolved config, written before the data is read; the empty data files then stop the run) holds lr's values but
    for the one given on the command line. A family without tuned values gets the WARNING."""
    import json

    data = movielens(tmp_path).data.dir
    common_args = ["--config=experiments/configs/dlrm_movielens.py", f"--config.data.dir={data}",
                   f"--config.data.prepared_dir={tmp_path / 'prepared'}"]
    result = launch(f"--workdir={tmp_path / 'lr'}", *common_args, "--config.model.name=lr",
                    "--config.optimizer.sparse.learning_rate=0.05")
    assert result.stdout.splitlines()[0] == (
        "model.name=lr: this config's lr defaults replace those it tuned for dlrm (config.model_defaults.lr): "
        "optimizer.dense.learning_rate 0.003 -> 0.01, optimizer.sparse.weight_decay 0.003 -> 0.0, train.batch_size "
        "512 -> 256, train.epochs 10 -> 20; kept as set explicitly: optimizer.sparse.learning_rate=0.05"), result.stdout
    resolved = json.loads((tmp_path / "lr" / "config.json").read_text())
    assert resolved["model"]["name"] == resolved["model"]["tuned_for"] == "lr"
    assert resolved["optimizer"]["sparse"] == {**resolved["optimizer"]["sparse"], "weight_decay": 0.0,
                                               "learning_rate": 0.05}
    assert (resolved["optimizer"]["dense"]["learning_rate"], resolved["train"]["batch_size"],
            resolved["train"]["epochs"]) == (0.01, 256, 20)
    result = launch(f"--workdir={tmp_path / 'wukong'}", *common_args, "--config.model.name=wukong")
    assert result.stdout.startswith("WARNING: model.name=wukong: this config's learning rates and regularisation were "
                                    "tuned for dlrm"), result.stdout
    assert not launch(f"--workdir={tmp_path / 'dlrm'}", *common_args).stdout.startswith(("model.name", "WARNING"))


def parse_config_flags(*args: str, config: str = "experiments/configs/dlrm_synthetic.py"):
    """The config the launcher's flags make of `args` (recjax/cli.py define_config_flag), parsed in-process."""
    from absl import flags

    from recjax import cli

    argv = ["train", *args]
    flag_values = flags.FlagValues()
    holder = cli.define_config_flag(REPO / config, flag_values=flag_values, argv=argv)
    flag_values(argv)
    cli.check_repeated_list_flags(argv, flag_values)
    return holder.value


def test_list_flags_are_comma_lists():
    """A tuple field on the command line: comma-separated items, each a number or else a string (ml_collections
    read `user,item` as the one column 'user,item'); a Python tuple is taken as written; empty is ()."""
    csv_config = "experiments/configs/dlrm_csv_clicks.py"
    assert parse_config_flags("--config.model.dlrm.top_mlp=64,1").model.dlrm.top_mlp == (64, 1)
    assert parse_config_flags("--config.model.dlrm.top_mlp=1").model.dlrm.top_mlp == (1,)
    assert parse_config_flags("--config.data.sparse.columns=user,item", config=csv_config
                              ).data.sparse.columns == ("user", "item")
    assert parse_config_flags("--config.data.sparse.columns= user , item ", config=csv_config
                              ).data.sparse.columns == ("user", "item")
    assert parse_config_flags("--config.data.sparse.columns=('user','item,2')", config=csv_config
                              ).data.sparse.columns == ("user", "item,2")
    assert parse_config_flags("--config.data.sparse.columns=user", config=csv_config).data.sparse.columns == ("user",)
    assert parse_config_flags("--config.data.dense.columns=", config=csv_config).data.dense.columns == ()
    mixed = parse_config_flags("--config.data.label.positive_values=yes,1,0.5,'2'", config=csv_config)
    assert mixed.data.label.positive_values == ("yes", 1, 0.5, "2")
    # Other fields keep their parsers: a scalar given twice keeps the last value (absl's rule).
    assert parse_config_flags("--config.train.steps=3", "--config.train.steps=5").train.steps == 5


def test_a_list_flag_given_twice_is_an_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_config_flags("--config.data.vocab_sizes=5,6", "--config.train.steps=3", "--config.data.vocab_sizes", "7")
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("error: --config.data.vocab_sizes is given twice (5,6 and 7); give the whole "
                                       "list once, comma-separated: --config.data.vocab_sizes=7\n")


def test_a_workdir_that_cannot_be_written_is_a_config_error(tmp_path):
    from recjax.guards import writable_directory
    from recjax.train import train_and_evaluate

    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match=rf"^--workdir: cannot use {tmp_path}/a_file/run as a directory: "
                                          rf"{tmp_path}/a_file is a file, not a directory; choose a directory you "
                                          "can write$"):
        train_and_evaluate(synthetic(), tmp_path / "a_file" / "run")
    config = synthetic()
    config.checkpoint.dir = str(tmp_path / "a_file" / "checkpoints")
    with pytest.raises(ConfigError, match=r"^checkpoint.dir: cannot use .*a_file/checkpoints as a directory: .*a_file "
                                          "is a file"):
        train_and_evaluate(config, tmp_path / "run")
    if pathlib.Path("/proc/self").is_dir():  # Linux: procfs makes no directories, whoever asks
        with pytest.raises(ConfigError, match=r"^--workdir: cannot use /proc/run/x as a directory: "):
            writable_directory(pathlib.Path("/proc/run/x"), "--workdir")
    writable_directory(tmp_path / "new" / "run", "--workdir")  # made, parents too, and writable
    assert (tmp_path / "new" / "run").is_dir() and list((tmp_path / "new" / "run").iterdir()) == []


def test_debug_shows_the_traceback_and_a_failed_temp_workdir_is_removed(tmp_path):
    result = launch("--config.train.steps=0", "--debug")
    assert result.returncode != 0 and "Traceback" in result.stderr and "train.steps" in result.stderr
    # Without --workdir the run's temp directory is removed when the run fails.
    temp = tmp_path / "tmp"
    temp.mkdir()
    env_result = subprocess.run([sys.executable, "-m", "experiments.train", "--config.train.steps=0"],
                                capture_output=True, text=True, cwd=REPO,
                                env={**__import__("os").environ, "TMPDIR": str(temp)})
    assert env_result.returncode == 2 and list(temp.iterdir()) == []


def test_tune_malloc_applies_on_glibc_unless_the_user_chose(monkeypatch):
    """The entry points' malloc settings (recjax/cli.py tune_malloc): applied on glibc; left alone with
    RECJAX_MALLOC=default or when the user tuned malloc through GLIBC_TUNABLES or a MALLOC_*_ variable."""
    import platform

    from recjax import cli

    for key in [k for k in os.environ if k.startswith("MALLOC_") or k in ("GLIBC_TUNABLES", cli.MALLOC_ENV)]:
        monkeypatch.delenv(key)
    assert cli.tune_malloc() == (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc")
    for key, value in ((cli.MALLOC_ENV, "default"), ("GLIBC_TUNABLES", "glibc.malloc.arena_max=2"),
                       ("MALLOC_TRIM_THRESHOLD_", "1000000")):
        with monkeypatch.context() as env:
            env.setenv(key, value)
            assert cli.tune_malloc() is False, key
