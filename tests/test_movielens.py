"""MovieLens: ML-100K against brute-force counts over its files, the 1M and latest-small parsers on fabricated
files in their exact formats, the splits, the errors, and LR vs DLRM trained end to end on ML-100K."""

import os
import pathlib

import ml_collections
import numpy as np
import pytest

from recjax.data.movielens import (
    GENRES_100K,
    movielens_dataset,
    prepare_examples,
    read_movielens,
    split_indices,
)
from recjax.errors import DataError

REPO = pathlib.Path(__file__).resolve().parents[1]


def _shared_data() -> pathlib.Path:
    return pathlib.Path(os.environ.get("RECJAX_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="module")
def ml100k_dir() -> pathlib.Path:
    directory = _shared_data() / "movielens_100k"
    if not (directory / "u.data").is_file():
        pytest.skip(f"ML-100K not found at {directory} (set RECJAX_SHARED_DATA to the folder holding "
                    "movielens_100k/ with u.data, u.user, u.item)")
    return directory


@pytest.fixture(scope="module")
def u_data(ml100k_dir) -> np.ndarray:
    """u.data as i64[100000, 4] (user, item, rating, timestamp), read with the plainest possible parser."""
    return np.asarray([[int(x) for x in line.split("\t")] for line in (ml100k_dir / "u.data").read_text().splitlines()])


def data_config(directory, **overrides) -> ml_collections.ConfigDict:
    """dlrm_movielens.py's data section for `directory`, with fields overridden (split fields by their own name:
    method, validation_fraction, test_fraction, seed)."""
    from experiments.configs import dlrm_movielens

    config = dlrm_movielens.data_config()
    config.dir = str(directory)
    for key, value in overrides.items():
        (config.split if key in config.split else config)[key] = value
    return config


def pairs(dataset, split: str) -> set[tuple[int, int]]:
    """(user, item) dense ids of every example of a split; unique per rating in MovieLens."""
    batch = dataset.splits[split]
    return set(zip(batch.ids["user"][:, 0].tolist(), batch.ids["item"][:, 0].tolist(), strict=True))


# ----------------------------------------------------------------------------------------------- ML-100K
def test_100k_sizes_and_vocabularies(ml100k_dir):
    dataset = movielens_dataset(data_config(ml100k_dir), seed=0)
    info = dataset.info()
    assert info["variant"] == "100k"
    assert info["split_sizes"] == {"train": 80_000, "validation": 10_000, "test": 10_000}
    assert (info["num_users"], info["num_items"]) == (943, 1682)
    vocab = {f.name: f.vocab_size for f in dataset.spec.features}
    assert vocab == {"user": 943, "item": 1682, "age_bucket": 7, "gender": 2, "occupation": 21,
                     "zip_prefix": vocab["zip_prefix"], "genres": 19}
    genres = dataset.spec.features[-1]
    assert genres.bag_size == 6  # the most genres any ML-100K movie has
    assert dataset.spec.num_dense == 2 and info["dense_features"] == ["release_year", "age"]
    for name, size in (("user", 943), ("item", 1682)):
        seen = np.concatenate([dataset.splits[s].ids[name][:, 0] for s in ("train", "validation", "test")])
        assert np.array_equal(np.unique(seen), np.arange(size)), name  # dense: every index used, none beyond


def test_100k_positive_rate_matches_brute_force(ml100k_dir, u_data):
    for threshold in (4.0, 3.0, 5.0):
        dataset = movielens_dataset(data_config(ml100k_dir, rating_threshold=threshold), seed=0)
        positives = sum(1 for rating in u_data[:, 2] if rating >= threshold)
        assert dataset.info()["positive_rate"] == pytest.approx(positives / 100_000, abs=1e-12)
        assert sum(int(dataset.splits[s].labels.sum()) for s in ("train", "validation", "test")) == positives
    assert positives == 21_201  # 5-star ratings (ML-100K README)


def test_100k_features_of_hand_checked_movies_and_users(ml100k_dir, u_data):
    spec, examples, vocab = prepare_examples(read_movielens(ml100k_dir))
    assert examples.size == 100_000
    # Raw ids are dense 1..943 and 1..1682 in ML-100K, so index = raw id - 1.
    assert vocab["user"] == list(range(1, 944)) and vocab["item"] == list(range(1, 1683))
    np.testing.assert_array_equal(examples.ids["user"][:, 0], u_data[:, 0] - 1)
    np.testing.assert_array_equal(examples.ids["item"][:, 0], u_data[:, 1] - 1)
    # From u.item: 1 Toy Story, 2 GoldenEye, 3 Four Rooms, 267 has no title and only the "unknown" flag,
    # 1682 Scream of Stone (Drama).
    hand = {1: {"Animation", "Children's", "Comedy"}, 2: {"Action", "Adventure", "Thriller"}, 3: {"Thriller"},
            267: {"unknown"}, 1682: {"Drama"}}
    for movie, genres in hand.items():
        rows = np.flatnonzero(u_data[:, 1] == movie)
        assert rows.size > 0
        lengths = examples.lengths["genres"][rows]
        assert np.all(lengths == len(genres)), movie
        names = {vocab["genres"][g] for g in examples.ids["genres"][rows[0], :len(genres)]}
        assert names == genres, movie
    assert vocab["genres"] == list(GENRES_100K)
    # u.user line 1: "1|24|M|technician|85711"; line 2: "2|53|F|other|94043".
    for user, (bucket, gender, occupation, zip_prefix) in {1: (18, "M", "technician", "857"),
                                                           2: (50, "F", "other", "940")}.items():
        row = int(np.flatnonzero(u_data[:, 0] == user)[0])
        assert vocab["age_bucket"][examples.ids["age_bucket"][row, 0]] == bucket
        assert vocab["gender"][examples.ids["gender"][row, 0]] == gender
        assert vocab["occupation"][examples.ids["occupation"][row, 0]] == occupation
        assert vocab["zip_prefix"][examples.ids["zip_prefix"][row, 0]] == zip_prefix
    # Dense: standardised over the 1,682 movies (release year) and 943 users (age).
    year, age = examples.dense[:, 0], examples.dense[:, 1]
    _, first = np.unique(u_data[:, 1], return_index=True)
    assert year[first].mean() == pytest.approx(0.0, abs=1e-5) and year[first].std() == pytest.approx(1.0, abs=0.01)
    toy_story, movie_267 = (int(np.flatnonzero(u_data[:, 1] == m)[0]) for m in (1, 267))
    assert movie_267 and year[movie_267] == 0.0  # no release date: imputed with the mean
    assert year[toy_story] > 0  # 1995 is later than the average ML-100K movie
    user_1, user_2 = (int(np.flatnonzero(u_data[:, 0] == u)[0]) for u in (1, 2))
    assert age[user_2] > age[user_1]  # 53 > 24


def test_random_split_is_deterministic_by_seed_and_disjoint(ml100k_dir):
    a, b = (movielens_dataset(data_config(ml100k_dir), seed=0) for _ in range(2))
    c = movielens_dataset(data_config(ml100k_dir), seed=1)
    for split in ("train", "validation", "test"):
        for name in a.splits[split].ids:
            np.testing.assert_array_equal(a.splits[split].ids[name], b.splits[split].ids[name])
        np.testing.assert_array_equal(a.splits[split].labels, b.splits[split].labels)
    train, validation, test = pairs(a, "train"), pairs(a, "validation"), pairs(a, "test")
    assert (len(train), len(validation), len(test)) == (80_000, 10_000, 10_000)
    assert not train & test and not train & validation and not validation & test
    # The run's seed orders training only: the held-out sets stay.
    assert pairs(c, "test") == test and pairs(c, "validation") == validation
    # Another split seed is a fresh draw (overlapping ~10% by chance).
    d = movielens_dataset(data_config(ml100k_dir, seed=1), seed=0)
    assert len(pairs(d, "test") & test) < 2_000 and d.info()["split"]["seed"] == 1


def test_time_split_puts_the_latest_ratings_in_test(ml100k_dir, u_data):
    dataset = movielens_dataset(data_config(ml100k_dir, method="time", test_fraction=0.2,
                                            validation_fraction=0.1), seed=0)
    order = sorted(range(len(u_data)), key=lambda i: (u_data[i, 3], i))  # brute force: by time, then file order
    as_pairs = lambda rows: {(int(u_data[i, 0]) - 1, int(u_data[i, 1]) - 1) for i in rows}  # noqa: E731
    latest, before = as_pairs(order[-20_000:]), as_pairs(order[-30_000:-20_000])
    assert pairs(dataset, "test") == latest and pairs(dataset, "validation") == before
    assert not pairs(dataset, "train") & (latest | before)
    # The same split from any seed.
    other = movielens_dataset(data_config(ml100k_dir, method="time", test_fraction=0.2, validation_fraction=0.1),
                              seed=7)
    assert pairs(other, "test") == latest


def test_split_indices_edge_cases():
    train, validation, test = split_indices(np.asarray([5, 1, 5, 3, 2, 6]), "time", 0.2, 0.4, seed=0)
    # Latest first: t=6 and the two t=5 ties (the later line first) are test-and-validation material.
    assert test.tolist() == [2, 5] and validation.tolist() == [0] and train.tolist() == [1, 3, 4]
    train, validation, test = split_indices(np.asarray([1, 1, 1, 1, 1]), "time", 0.2, 0.2, seed=0)
    assert test.tolist() == [4] and validation.tolist() == [3]  # ties broken by file order
    with pytest.raises(ValueError, match=r"data.split.test_fraction: must be in \(0, 1\)"):
        split_indices(np.arange(10), "random", 0.1, 1.0, seed=0)
    with pytest.raises(ValueError, match="3 ratings cannot be split into train, validation"):
        split_indices(np.arange(3), "random", 0.1, 0.1, seed=0)
    with pytest.raises(ValueError, match="data.split.method: unknown MovieLens split 'weekly'"):
        split_indices(np.arange(10), "weekly", 0.1, 0.1, seed=0)


# ----------------------------------------------------------------------------- 1M and latest-small parsers
def write_1m(directory: pathlib.Path) -> pathlib.Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "ratings.dat").write_text(
        "1::1193::5::978300760\n1::661::3::978302109\n2::1193::4::978298413\n"
        "10::2::1::978301968\n10::661::4::978300000\n")
    (directory / "users.dat").write_text("1::F::1::10::48067\n2::M::56::16::70072-1234\n10::M::35::0::95370\n")
    (directory / "movies.dat").write_bytes(
        "2::Jumanji (1995)::Adventure|Children's|Fantasy\n"
        "661::James and the Giant Peach (1996)::Animation|Children's|Musical\n"
        "1193::One Flew Over the Cuckoo's Nest (1975)::Drama\n"
        "3::Misérables, Les (1995)::Drama|Musical\n".encode("latin-1"))  # unrated: not in the item vocabulary
    return directory


def test_1m_parser_on_fabricated_files(tmp_path):
    directory = write_1m(tmp_path / "ml-1m")
    tables = read_movielens(directory)
    assert tables.variant == "1m"
    assert tables.movies[3].title == "Misérables, Les (1995)"  # latin-1 decoded
    assert tables.movies[2].genres == ("Adventure", "Children's", "Fantasy") and tables.movies[1193].year == 1975
    spec, examples, vocab = prepare_examples(tables)
    assert vocab["user"] == [1, 2, 10] and vocab["item"] == [2, 661, 1193]
    assert examples.ids["user"][:, 0].tolist() == [0, 0, 1, 2, 2]
    assert examples.ids["item"][:, 0].tolist() == [2, 1, 2, 0, 1]
    assert examples.labels.tolist() == [1, 0, 1, 0, 1]
    assert vocab["genres"] == sorted({"Adventure", "Children's", "Fantasy", "Animation", "Musical", "Drama"})
    assert spec.features[-1].bag_size == 3 and examples.lengths["genres"].tolist() == [1, 3, 1, 3, 3]
    assert [vocab["age_bucket"][i] for i in examples.ids["age_bucket"][:, 0]] == [1, 1, 56, 35, 35]
    assert [vocab["gender"][i] for i in examples.ids["gender"][:, 0]] == ["F", "F", "M", "M", "M"]
    assert [vocab["occupation"][i] for i in examples.ids["occupation"][:, 0]] == ["10", "10", "16", "0", "0"]
    assert {f.name: f.vocab_size for f in spec.features}["occupation"] == 21  # the README's codes 0..20
    assert vocab["zip_prefix"] == ["480", "700", "953"]
    assert vocab["dense"] == ["release_year", "age"]
    ages = examples.dense[:, 1]  # group midpoints 16, 60, 39.5, standardised over the three users
    mid = np.asarray([16.0, 60.0, 39.5])
    np.testing.assert_allclose(ages, ((mid - mid.mean()) / mid.std())[[0, 0, 1, 2, 2]], rtol=1e-5)


def write_latest_small(directory: pathlib.Path) -> pathlib.Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "ratings.csv").write_text(
        "userId,movieId,rating,timestamp\n1,1,4.0,964982703\n1,11,3.5,964981247\n5,11,4.5,847434962\n"
        "5,176371,0.5,1527000000\n")
    (directory / "movies.csv").write_text(
        'movieId,title,genres\n1,Toy Story (1995),Adventure|Animation|Children|Comedy|Fantasy\n'
        '11,"American President, The (1995)",Comedy|Drama|Romance\n'
        '176371,"Blade Runner 2049 (2017)",Sci-Fi\n'
        '114335,La cravate (1957),(no genres listed)\n', encoding="utf-8")
    return directory


def test_latest_small_parser_on_fabricated_files(tmp_path):
    directory = write_latest_small(tmp_path / "ml-latest-small")
    tables = read_movielens(directory)
    assert tables.variant == "latest-small" and tables.users is None
    assert tables.movies[11].title == "American President, The (1995)"  # quoted title with a comma
    assert tables.movies[114335].genres == ()  # "(no genres listed)" is an empty bag
    assert tables.ratings.tolist() == [4.0, 3.5, 4.5, 0.5]
    spec, examples, vocab = prepare_examples(tables, rating_threshold=4.0)
    assert spec.feature_names == ("user", "item", "genres")  # no demographics in this variant
    assert spec.num_dense == 1 and vocab["dense"] == ["release_year"]
    assert examples.labels.tolist() == [1, 0, 1, 0]  # half stars: 3.5 < 4 <= 4.5
    assert spec.features[-1].bag_size == 5 and examples.lengths["genres"].tolist() == [5, 3, 3, 1]
    assert examples.ids["item"][:, 0].tolist() == [0, 1, 1, 2]
    years = examples.dense[:, 0]
    assert years[3] > years[0]  # 2017 after 1995
    config = data_config(directory, test_fraction=0.25, validation_fraction=0.25)
    config.variant = "latest-small"
    dataset = movielens_dataset(config, seed=0)
    assert dataset.info()["split_sizes"] == {"train": 2, "validation": 1, "test": 1}
    assert dataset.info()["num_items"] == 3


def test_latest_small_genre_free_movie_gives_an_empty_bag(tmp_path):
    directory = write_latest_small(tmp_path / "ml")
    with (directory / "ratings.csv").open("a") as f:
        f.write("5,114335,5.0,1500000000\n")
    spec, examples, vocab = prepare_examples(read_movielens(directory))
    assert examples.lengths["genres"][-1] == 0 and examples.labels[-1] == 1
    assert "(no genres listed)" not in vocab["genres"]


@pytest.mark.parametrize("filename, line, message", [
    ("ratings.dat", "3::1193::4\n", r"ratings.dat:2: expected 4 '::'-separated fields"),
    ("ratings.dat", "3::1193::four::978298413\n", r"ratings.dat:2: rating 'four' is not a valid float"),
    ("users.dat", "3::X::25::1::12345\n", r"users.dat:4: gender 'X'"),
    ("users.dat", "3::M::30::1::12345\n", r"users.dat:4: age group 30 is not one of"),
    ("movies.dat", "1193::Duplicate (1975)::Drama\n", r"movies.dat:5: movie id 1193 appears twice"),
])
def test_malformed_lines_name_file_and_line(tmp_path, filename, line, message):
    directory = write_1m(tmp_path / "ml-1m")
    path = directory / filename
    lines = path.read_bytes().decode("latin-1").splitlines(keepends=True)
    lines.insert(1 if filename == "ratings.dat" else len(lines), line)
    path.write_bytes("".join(lines).encode("latin-1"))
    with pytest.raises(DataError, match=message):  # a user error (one line from the launcher), not a traceback
        read_movielens(directory)


def test_malformed_csv_and_unknown_movie(tmp_path):
    directory = write_latest_small(tmp_path / "ml")
    (directory / "movies.csv").write_text("movieId,title,genres\n1,Toy Story, (1995),Comedy\n")
    with pytest.raises(DataError, match=r"movies.csv:2: expected 3 CSV fields"):
        read_movielens(directory)
    directory = write_latest_small(tmp_path / "ml2")
    (directory / "movies.csv").write_text("movieId,title,genres\n1,Toy Story (1995),Comedy\n")
    with pytest.raises(DataError, match=r"2 rated movie ids are not in the movies file, e.g. \[11, 176371\]"):
        prepare_examples(read_movielens(directory))


def test_binary_files_are_data_errors_naming_file_and_line(tmp_path):
    """Binary garbage in place of a ratings or movies file: a DataError naming the file (and line), not a
    UnicodeDecodeError / _csv.Error traceback."""
    directory = write_latest_small(tmp_path / "ml")
    good = (directory / "ratings.csv").read_bytes()
    (directory / "ratings.csv").write_bytes(good + b"7,\xff\xfe\x00,\x89PNG\n")
    lines = good.count(b"\n")
    with pytest.raises(DataError, match=rf"ratings.csv:{lines + 1}: not utf-8 text \(invalid start byte at byte 2 of "
                                        r"the line\); is this the MovieLens file it is named after\?"):
        read_movielens(directory)
    directory = write_latest_small(tmp_path / "ml2")
    (directory / "movies.csv").write_bytes(b"movieId,title,genres\n1,Toy Story,Comedy\n2," + b"A" * 200_000 + b",x\n")
    with pytest.raises(DataError, match=r"movies.csv:3: cannot be read as CSV \(field larger than field limit"):
        read_movielens(directory)
    (directory / "movies.csv").write_bytes(b"movieId,title,genres\n1,\xc9\x00,Comedy\n")
    with pytest.raises(DataError, match=r"movies.csv: not UTF-8 text \(invalid continuation byte\)"):
        read_movielens(directory)


# ------------------------------------------------------------------------------------------------- errors
def test_missing_directory_says_what_to_download_and_where(tmp_path):
    with pytest.raises(ValueError) as error:
        movielens_dataset(data_config(tmp_path / "nowhere"), seed=0)
    text = str(error.value)
    for expected in (str(tmp_path / "nowhere"), "does not exist", "https://grouplens.org/datasets/movielens/",
                     "u.data, u.user, u.item", "ratings.dat, users.dat, movies.dat", "ratings.csv, movies.csv",
                     "ml-100k.zip", "--config.data.dir="):
        assert expected in text, expected
    with pytest.raises(ValueError, match="config.data.dir is empty"):
        movielens_dataset(data_config(""), seed=0)


def test_directory_errors_point_at_the_right_files(tmp_path):
    write_1m(tmp_path / "ml-1m")
    pattern = r"(?s)no ratings file \(u.data, ratings.dat or ratings.csv\) in .*ml-1m/: set --config.data.dir=\S*ml-1m"
    with pytest.raises(ValueError, match=pattern):
        read_movielens(tmp_path)  # the parent of the unzipped folder
    (tmp_path / "ml-1m" / "movies.dat").unlink()
    with pytest.raises(ValueError, match=r"lacks movies.dat of the 1m variant"):
        read_movielens(tmp_path / "ml-1m")
    write_1m(tmp_path / "ml-1m")
    with pytest.raises(ValueError, match=r"lacks u.data, u.user, u.item of the 100k variant"):
        read_movielens(tmp_path / "ml-1m", variant="100k")
    write_latest_small(tmp_path / "ml-1m")
    with pytest.raises(ValueError, match=r"several variants \(\['1m', 'latest-small'\]\)"):
        read_movielens(tmp_path / "ml-1m")
    assert read_movielens(tmp_path / "ml-1m", variant="latest-small").variant == "latest-small"
    with pytest.raises(ValueError, match="unknown MovieLens variant '10m'"):
        read_movielens(tmp_path / "ml-1m", variant="10m")


# --------------------------------------------------------------------------------------------- end to end
def check_selection(summary: dict, metrics_csv: pathlib.Path, patience: int) -> None:
    """The summary's selected step is the first best validation AUC in metrics.csv, its `selection.logloss` the first
    lowest validation logloss; test was scored exactly at the steps that improved either, and the summary reports it
    at both; an early stop came after `patience` evaluations without an AUC improvement."""
    import csv

    rows = list(csv.DictReader(metrics_csv.open()))
    validation = [(int(r["step"]), float(r["auc"]), float(r["logloss"])) for r in rows if r["split"] == "validation"]
    test = {int(r["step"]): (float(r["auc"]), float(r["logloss"])) for r in rows if r["split"] == "test"}
    improving, scored, best, lowest = [], [], -1.0, float("inf")
    for step, auc, loss in validation:
        if auc > best or loss < lowest:
            scored.append(step)
        if auc > best:
            improving.append(step)
            best = auc
        if loss < lowest:
            lowest_step, lowest = step, loss
    assert summary["selected_step"] == improving[-1] and summary["validation"]["auc"] == best
    assert sorted(test) == scored and summary["auc"] == test[improving[-1]][0]
    chosen = summary["selection"]["logloss"]
    assert chosen["step"] == lowest_step and chosen["validation"]["logloss"] == lowest
    assert (chosen["test"]["auc"], chosen["test"]["logloss"]) == test[lowest_step]
    if summary["stopped_early"]:
        assert summary["steps"] < summary["budget_steps"]
        assert [v[0] for v in validation][-patience - 1] == improving[-1]
    else:
        assert summary["steps"] == summary["budget_steps"]


def test_training_batches_mix_users_even_when_the_ratings_file_is_sorted_by_user(tmp_path):
    """ML-1M's ratings.dat lists each user's ratings together. Training shuffles prepared blocks and the rows within
    a block, so train rows stored in file order reached the model user by user: a batch drew only on one block's
    users (92 distinct users where uniform sampling gives 228). Stored shuffled, a batch's distinct users are what
    sampling train uniformly gives."""
    from experiments import make_movielens_like
    from experiments.configs import dlrm_movielens
    from recjax.data import make_dataset

    make_movielens_like.write(tmp_path / "ml", seed=0, users=300, movies=400, ratings=18_000, min_user_ratings=30)
    users = [int(line.split("::")[0]) for line in (tmp_path / "ml" / "ratings.dat").read_text().splitlines()]
    assert users == sorted(users)  # the file is grouped by user, as ML-1M's
    config = dlrm_movielens.data_config()
    config.dir, config.prepared_dir = str(tmp_path / "ml"), str(tmp_path / "prepared")
    dataset = make_dataset(config, seed=0)
    epoch = take_batches(dataset.train_batches(512), dataset.num_examples("train") // 512)
    counts = np.bincount(np.concatenate([b.ids["user"][:, 0] for b in epoch]), minlength=300)
    p = counts / counts.sum()  # each user's share of train (nearly one epoch of it)
    expected = np.sum(1 - (1 - p) ** 512)  # distinct users in 512 uniform draws
    for batch in take_batches(dataset.train_batches(512, start_step=7), 3):
        distinct = np.unique(batch.ids["user"][:, 0]).size
        assert abs(distinct - expected) < 0.1 * expected, (distinct, expected)


def take_batches(stream, n: int) -> list:
    return [next(stream) for _ in range(n)]


@pytest.mark.slow  # trains DLRM and LR on ML-100K
def test_dlrm_beats_logistic_regression_on_ml100k(ml100k_dir, tmp_path):
    """Both from the DLRM config (`model.name` swaps the model), each with early stopping on validation."""
    from experiments.configs import dlrm_movielens, lr_movielens
    from recjax.train import train_and_evaluate

    auc = {}
    for name, module in (("lr", lr_movielens), ("dlrm", dlrm_movielens)):
        config = module.get_config()
        config.data.dir = str(ml100k_dir)
        config.data.prepared_dir = str(tmp_path / "prepared")  # never write into the user's TFDS data dir
        config.train.progress_bar = False
        summary = train_and_evaluate(config, tmp_path / name)
        assert summary["variant"] == "100k" and summary["test"]["eval_examples"] == 10_000
        assert summary["validation"]["eval_examples"] == 10_000 and summary["examples_per_epoch"] == 80_000
        check_selection(summary, tmp_path / name / "metrics.csv", config.train.early_stopping_patience)
        auc[name] = summary["auc"]
    assert auc["lr"] > 0.74, auc
    assert auc["dlrm"] > auc["lr"], auc
