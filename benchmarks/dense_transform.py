r"""Which `data.dense.transform` should the tabular path default to? Test AUC of DLRM per transform, on real data.

    RECJAX_SHARED_DATA=/path/to/shared/data python benchmarks/dense_transform.py
    python benchmarks/dense_transform.py --datasets=movielens --seeds=0,1,2 --transforms=none,standardise

Two data sets from $RECJAX_SHARED_DATA (never downloaded, never copied into the repository), written as the CSV / TSV
files a user would bring, into a temporary directory, and read by `data.name = "tabular"`:
  movielens  ML-100K (`movielens_100k/`): u.data joined with u.user and u.item into one CSV with a header, label
             rating >= 4; sparse user, item, gender, occupation, zip, genres (multi-valued, '|'); dense age and the
             release year, raw (a user's columns as they come: ~30 and ~1990).
  criteo     the Criteo Kaggle sample (`criteo_kaggle_sample/train.txt`, 1,999 lines): the TSV as it is, no header,
             label column 0, dense 1-13 (counts, heavy-tailed, some -1..-3 and empty), sparse 14-39.
Per data set, transform and seed (config.seed and data.split.seed both = the seed; a random 80/10/10 split): DLRM
with the ML-100K config's model and optimizer (experiments/configs/dlrm_movielens.py), early stopping on validation
AUC, test at the selected step. `clip+log1p+standardise` clips at data.dense.clip_min = 0 (Criteo's convention:
negatives -> 0, then log(x + 1)).

Prints one JSON line per run, then one per (data set, transform) with the mean and std over seeds and the mean gap
to `none`. The figures and the decision they support are in benchmarks/RESULTS.md.
"""

import argparse
import json
import os
import pathlib
import platform
import sys
import tempfile

_REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

import numpy as np  # noqa: E402

SHARED = pathlib.Path(os.environ.get("RECJAX_SHARED_DATA", _REPO_ROOT.parent / "shared" / "data"))
TRANSFORMS = ("none", "standardise", "clip+log1p+standardise")


def write_movielens(source: pathlib.Path, out: pathlib.Path) -> None:
    """u.data + u.user + u.item -> one CSV with a header (rating, user, item, age, gender, occupation, zip, year,
    genres)."""
    users = {}
    for line in (source / "u.user").read_text(encoding="latin-1").splitlines():
        user, age, gender, occupation, zipcode = line.split("|")
        users[user] = (age, gender, occupation, zipcode)
    items = {}
    for line in (source / "u.item").read_text(encoding="latin-1").splitlines():
        fields = line.split("|")
        year = fields[2][-4:] if fields[2] else ""  # "01-Jan-1995"; empty for one item (missing)
        genres = "|".join(str(g) for g, flag in enumerate(fields[5:]) if flag == "1")
        items[fields[0]] = (year, genres)
    rows = ["rating,user,item,age,gender,occupation,zip,year,genres"]
    for line in (source / "u.data").read_text().splitlines():
        user, item, rating, _ = line.split("\t")
        age, gender, occupation, zipcode = users[user]
        year, genres = items[item]
        rows.append(f"{rating},{user},{item},{age},{gender},{occupation},{zipcode},{year},{genres}")
    out.write_text("\n".join(rows) + "\n")


def data_config(name: str, directory: pathlib.Path, transform: str, seed: int, prepared: pathlib.Path):
    from recjax.data.tabular import default_data_config

    data = default_data_config()
    data.dir, data.prepared_dir = str(directory), str(prepared)
    data.split.seed = seed
    data.dense.transform = transform
    if "clip" in transform:
        data.dense.clip_min = 0.0
    if name == "movielens":
        data.files = "ml100k.csv"
        data.label.column, data.label.threshold = "rating", 4.0
        data.dense.columns = ("age", "year")
        data.sparse.columns = ("user", "item", "gender", "occupation", "zip", "genres")
        data.sparse.multi_valued = ("genres",)
    else:
        data.files = "train.txt"
        data.csv.delimiter, data.csv.header = "\t", False
        data.label.column = "0"
        data.dense.columns = tuple(str(i) for i in range(1, 14))
        data.sparse.columns = tuple(str(i) for i in range(14, 40))
    return data


def run(name: str, directory: pathlib.Path, transform: str, seed: int, work: pathlib.Path) -> dict:
    from experiments.configs import dlrm_movielens
    from recjax.train import train_and_evaluate

    config = dlrm_movielens.get_config()
    config.seed = seed
    config.data = data_config(name, directory, transform, seed, work / "prepared")
    config.train.progress_bar = False
    config.checkpoint.enabled = False
    if name == "criteo":  # 1,600 train rows: smaller batches, so an epoch is more than 3 steps
        config.train.batch_size = 64
    summary = train_and_evaluate(config, work / f"{name}_{transform}_{seed}")
    return {"dataset": name, "transform": transform, "seed": seed, "test_auc": summary["test"]["auc"],
            "test_logloss": summary["test"]["logloss"], "selected_step": summary["selected_step"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", default="movielens,criteo")
    parser.add_argument("--transforms", default=",".join(TRANSFORMS))
    parser.add_argument("--seeds", default="0,1,2")
    args = parser.parse_args()
    machine = {"cpus": os.cpu_count(), "python": platform.python_version()}
    results = []
    with tempfile.TemporaryDirectory(prefix="recjax_dense_transform_") as tmp:
        work = pathlib.Path(tmp)
        directories = {}
        for name in args.datasets.split(","):
            directories[name] = work / name
            directories[name].mkdir()
            if name == "movielens":
                write_movielens(SHARED / "movielens_100k", directories[name] / "ml100k.csv")
            else:
                (directories[name] / "train.txt").symlink_to(SHARED / "criteo_kaggle_sample" / "train.txt")
        for name in directories:
            for transform in args.transforms.split(","):
                for seed in (int(s) for s in args.seeds.split(",")):
                    result = run(name, directories[name], transform, seed, work)
                    results.append(result)
                    print(json.dumps({"measurement": "dense_transform_run", **result, "machine": machine}),
                          flush=True)
    for name in directories:
        base = [r["test_auc"] for r in results if r["dataset"] == name and r["transform"] == "none"]
        for transform in args.transforms.split(","):
            aucs = [r["test_auc"] for r in results if r["dataset"] == name and r["transform"] == transform]
            line = {"measurement": "dense_transform", "dataset": name, "transform": transform, "seeds": len(aucs),
                    "test_auc_mean": float(np.mean(aucs)), "test_auc_std": float(np.std(aucs))}
            if base and len(base) == len(aucs):
                line["auc_gap_to_none"] = float(np.mean(np.array(aucs) - np.array(base)))
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
