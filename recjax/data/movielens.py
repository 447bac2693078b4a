r"""MovieLens ratings as a binary ranking task ("does the user rate this movie >= threshold?") or as rating
regression (predict the stars: `config.target = "rating"`, the matrix-factorisation setting).

Reads the unzipped GroupLens files (https://grouplens.org/datasets/movielens/); nothing is downloaded:

    variant        files                                   format
    100k           u.data, u.user, u.item                  tab / '|' separated; u.item is latin-1
    1m             ratings.dat, users.dat, movies.dat      '::' separated; movies.dat is latin-1
    latest-small   ratings.csv, movies.csv                 CSV with a header, UTF-8, quoted titles, half stars

`config.variant = "auto"` picks the variant whose ratings file is in `config.dir`.

One example per rating. Sparse features (one-hot unless noted), in this order:

    user         user id, re-indexed densely 0..U-1 in ascending raw-id order (users that rated something)
    item         movie id, re-indexed densely 0..I-1 in ascending raw-id order (movies that were rated)
    age_bucket   100k/1m: MovieLens-1M's 7 age groups (<18, 18-24, 25-34, 35-44, 45-49, 50-55, 56+); the exact
                 100k ages are bucketed the same way so both variants share the feature's meaning
    gender       100k/1m: F, M
    occupation   100k/1m: 100k's 21 occupation names (sorted), 1m's 21 codes 0..20
    zip_prefix   100k/1m: the first `zip_prefix_length` (default 3) characters of the zip code, upper-cased:
                 a US ZIP3 is one postal sectional centre (~900 in the US), coarse enough that most prefixes
                 are shared by several users; 100k's few Canadian postal codes keep their first characters
    genres       multi-hot: the movie's genres; bag_size = the most genres any rated movie has, lengths = the
                 movie's count. 100k: its 19 flag columns (including "unknown"); 1m and latest-small: the
                 sorted genre names. latest-small's "(no genres listed)" is an empty bag (length 0).

Only latest-small lacks demographics: it has user, item and genres.

Dense features, standardised over the entities (items or users) in the data, so they carry no labels:

    release_year   the movie's year (100k: its release date; 1m/latest-small: the "(1995)" ending the title);
                   unknown years are set to the mean (0 after standardising)
    age            100k: the user's age; 1m: the midpoint of the user's age group (the data has no exact
                   ages); absent for latest-small

Label (`config.target`): "binary" (the default), rating >= `config.rating_threshold` (default 4.0: 4 and 5 stars are
positive; 55.4% of ML-100K); or "rating", the stars themselves (the spec's target "regression": squared error,
recjax/task.py OBJECTIVES).

Features (`config.features`): "all" (the default: every feature above) or "user_item" (only the user and item ids,
no dense features: collaborative filtering as matrix factorisation sees it, `model.name = "mf"`).

Splits "train", "validation", "test" (`config.split`: method, validation_fraction and test_fraction, default
0.1 each, and seed):
    random   uniformly random subsets drawn with `split.seed` (independent of the run's seed, so changing the run's
             seed does not change the held-out sets)
    time     the latest ratings by timestamp are test, the ones before them validation (ties broken by file
             order), so both are the future of train; users and movies first seen then keep their initial
             embeddings
"""

import csv
import dataclasses
import math
import pathlib
import re

import ml_collections
import numpy as np

from recjax.batch import Batch
from recjax.data.arrays import ArrayDataset, take
from recjax.errors import ConfigError, DataError
from recjax.specs import SPLITS, DatasetSpec, FeatureSpec

VARIANTS = ("100k", "1m", "latest-small")
TARGETS = ("binary", "rating")  # config.target: the >= threshold label, or the stars
FEATURE_SETS = ("all", "user_item")  # config.features
# Files each variant needs, the first being the ratings file that identifies the variant.
VARIANT_FILES = {
    "100k": ("u.data", "u.user", "u.item"),
    "1m": ("ratings.dat", "users.dat", "movies.dat"),
    "latest-small": ("ratings.csv", "movies.csv"),
}
DOWNLOADS = {
    "100k": "https://files.grouplens.org/datasets/movielens/ml-100k.zip",
    "1m": "https://files.grouplens.org/datasets/movielens/ml-1m.zip",
    "latest-small": "https://files.grouplens.org/datasets/movielens/ml-latest-small.zip",
}
_ZIP_DIRS = {"100k": "ml-100k", "1m": "ml-1m", "latest-small": "ml-latest-small"}

# The 19 genre flag columns of u.item, in column order (ML-100K README).
GENRES_100K = ("unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary",
               "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller",
               "War", "Western")
NO_GENRES = "(no genres listed)"  # latest-small's marker for a movie without genres

# MovieLens-1M's age groups: code -> (lowest age in the group, age used for the dense feature).
AGE_GROUPS = {1: (0, 16.0), 18: (18, 21.0), 25: (25, 29.5), 35: (35, 39.5), 45: (45, 47.0), 50: (50, 52.5),
              56: (56, 60.0)}
NUM_OCCUPATIONS_1M = 21  # users.dat codes 0..20 (ML-1M README)

_YEAR_IN_TITLE = re.compile(r"\((\d{4})(?:[-\u2013]\d{0,4})?\)\s*$")  # "(1995)" or "(2006-2007)" at the end


# ----------------------------------------------------------------------------------------------- raw tables
@dataclasses.dataclass(frozen=True)
class User:
    age_group: int  # a key of AGE_GROUPS
    age: float  # years (1m: the group's midpoint)
    gender: str  # "F" or "M"
    occupation: str  # 100k: a name; 1m: the code as a string
    zip_code: str


@dataclasses.dataclass(frozen=True)
class Movie:
    title: str
    genres: tuple[str, ...]
    year: float  # nan when unknown


@dataclasses.dataclass(frozen=True)
class MovieLensTables:
    """The files as parsed, with raw ids. `users` is None for latest-small (no demographics)."""

    variant: str
    user_ids: np.ndarray  # i64[N] raw user id of each rating, in file order
    item_ids: np.ndarray  # i64[N] raw movie id
    ratings: np.ndarray  # f32[N] stars
    timestamps: np.ndarray  # i64[N] seconds since the epoch
    users: dict[int, User] | None
    movies: dict[int, Movie]
    ratings_lines: int = 0  # physical lines of the ratings file (header and blank lines included)
    blank_lines: int = 0  # blank lines of the ratings file (skipped; every other line is a rating or an error)


def _missing_files_error(directory: pathlib.Path, variant: str, problem: str) -> ValueError:
    lines = [f"MovieLens: {problem}. Download and unzip one of the GroupLens sets "
             "(https://grouplens.org/datasets/movielens/) and point config.data.dir at the unzipped folder:"]
    for v in VARIANTS:
        if variant in ("auto", v):
            lines.append(f"  {v:<13} {', '.join(VARIANT_FILES[v])} directly in <dir>  "
                         f"(the {_ZIP_DIRS[v]}/ folder of {DOWNLOADS[v]})")
    if directory.is_dir():
        nested = [directory / d for d in _ZIP_DIRS.values() if (directory / d).is_dir()]
        if nested:
            lines.append(f"  {directory} has {', '.join(p.name + '/' for p in nested)}: set "
                         f"--config.data.dir={nested[0]}")
    lines.append("e.g. --config.data.dir=/path/to/ml-100k (config.data.variant='auto' detects the set)")
    return ValueError("\n".join(lines))


def detect_variant(directory: str | pathlib.Path, variant: str = "auto") -> str:
    """The variant whose files are in `directory` (checked when `variant` is given); ValueError saying what
    to download and where to put it otherwise."""
    if variant != "auto" and variant not in VARIANTS:
        raise ValueError(f"unknown MovieLens variant '{variant}'; use 'auto' or one of {list(VARIANTS)}")
    if not str(directory):
        raise _missing_files_error(pathlib.Path(), variant, "config.data.dir is empty")
    directory = pathlib.Path(directory).expanduser()
    if not directory.is_dir():
        raise _missing_files_error(directory, variant, f"directory {directory} does not exist")
    candidates = [variant] if variant != "auto" else [v for v in VARIANTS if (directory / VARIANT_FILES[v][0]).exists()]
    if variant == "auto" and len(candidates) > 1:
        raise ValueError(f"MovieLens: {directory} holds the ratings files of several variants ({candidates}); "
                         "set config.data.variant to one of them")
    if not candidates:
        raise _missing_files_error(directory, variant, f"no ratings file (u.data, ratings.dat or ratings.csv) in "
                                                       f"{directory}")
    missing = [f for f in VARIANT_FILES[candidates[0]] if not (directory / f).is_file()]
    if missing:
        raise _missing_files_error(directory, candidates[0],
                                   f"{directory} lacks {', '.join(missing)} of the {candidates[0]} variant")
    return candidates[0]


def _lines(path: pathlib.Path, encoding: str):
    """(1-based line number, line without its newline), skipping blank lines."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode(encoding).rstrip("\r\n")
            except UnicodeDecodeError as error:  # e.g. a binary file in place of the ratings
                raise DataError(f"{path}:{number}: not {encoding} text ({error.reason} at byte {error.start} of the "
                                "line); is this the MovieLens file it is named after?") from None
            if line.strip():
                yield number, line


def _fields(path: pathlib.Path, number: int, line: str, sep: str, count: int, layout: str) -> list[str]:
    fields = line.split(sep)
    if len(fields) != count:
        raise DataError(f"{path}:{number}: expected {count} '{sep}'-separated fields ({layout}), got "
                         f"{len(fields)}: {line[:200]!r}")
    return fields


def _number(path: pathlib.Path, number: int, text: str, what: str, kind: type = int):
    try:
        value = kind(text)
    except ValueError:
        raise DataError(f"{path}:{number}: {what} {text!r} is not a valid {kind.__name__}") from None
    if kind is float and not math.isfinite(value):
        raise DataError(f"{path}:{number}: {what} {text!r} is not finite")
    return value


def _read_ratings(path: pathlib.Path, sep: str, header: str | None = None):
    """Parse user, item, rating, timestamp lines; `header` is the expected first line (CSV) or None."""
    users, items, ratings, times = [], [], [], []
    layout = "user id, movie id, rating, timestamp"
    for number, line in _lines(path, "utf-8"):
        if header is not None and number == 1:
            if line.strip() != header:
                raise DataError(f"{path}:1: expected the header {header!r}, got {line[:200]!r}")
            continue
        u, i, r, t = _fields(path, number, line, sep, 4, layout)
        users.append(_number(path, number, u, "user id"))
        items.append(_number(path, number, i, "movie id"))
        ratings.append(_number(path, number, r, "rating", float))
        times.append(_number(path, number, t, "timestamp"))
    if not ratings:
        raise DataError(f"{path}: no ratings in the file" + (" (the file is empty)" if path.stat().st_size == 0
                                                                 else ""))
    with path.open("rb") as f:
        lines = sum(1 for _ in f)
    blank = lines - len(ratings) - (header is not None)
    return (np.asarray(users, np.int64), np.asarray(items, np.int64), np.asarray(ratings, np.float32),
            np.asarray(times, np.int64), lines, blank)


def _age_group(age: float) -> int:
    return max(code for code, (low, _) in AGE_GROUPS.items() if age >= low)


def _put(table: dict, key: int, value, path: pathlib.Path, number: int, what: str) -> None:
    if key in table:
        raise DataError(f"{path}:{number}: {what} {key} appears twice")
    table[key] = value


def _year_from_title(title: str) -> float:
    match = _YEAR_IN_TITLE.search(title)
    return float(match.group(1)) if match else math.nan


def _read_100k(directory: pathlib.Path) -> MovieLensTables:
    user_ids, item_ids, ratings, times, lines, blank = _read_ratings(directory / "u.data", "\t")
    users: dict[int, User] = {}
    path = directory / "u.user"
    for number, line in _lines(path, "latin-1"):
        uid, age, gender, occupation, zip_code = _fields(path, number, line, "|", 5,
                                                         "user id|age|gender|occupation|zip code")
        age = _number(path, number, age, "age")
        if gender not in ("F", "M"):
            raise DataError(f"{path}:{number}: gender {gender!r} is not 'F' or 'M'")
        _put(users, _number(path, number, uid, "user id"),
             User(_age_group(age), float(age), gender, occupation, zip_code), path, number, "user id")
    movies: dict[int, Movie] = {}
    path = directory / "u.item"
    for number, line in _lines(path, "latin-1"):
        fields = _fields(path, number, line, "|", 5 + len(GENRES_100K),
                         "movie id|title|release date|video release date|IMDb URL|19 genre flags")
        flags = fields[5:]
        if any(f not in ("0", "1") for f in flags):
            raise DataError(f"{path}:{number}: genre flags must be 0 or 1, got {'|'.join(flags)}")
        release = fields[2].strip()  # "01-Jan-1995"; empty for a few movies
        year = _number(path, number, release[-4:], "release year") if release else math.nan
        _put(movies, _number(path, number, fields[0], "movie id"),
             Movie(fields[1], tuple(g for g, f in zip(GENRES_100K, flags, strict=True) if f == "1"), float(year)),
             path, number, "movie id")
    return MovieLensTables("100k", user_ids, item_ids, ratings, times, users, movies, lines, blank)


def _read_1m(directory: pathlib.Path) -> MovieLensTables:
    user_ids, item_ids, ratings, times, lines, blank = _read_ratings(directory / "ratings.dat", "::")
    users: dict[int, User] = {}
    path = directory / "users.dat"
    for number, line in _lines(path, "latin-1"):
        uid, gender, age, occupation, zip_code = _fields(path, number, line, "::", 5,
                                                         "UserID::Gender::Age::Occupation::Zip-code")
        age = _number(path, number, age, "age group")
        if age not in AGE_GROUPS:
            raise DataError(f"{path}:{number}: age group {age} is not one of {sorted(AGE_GROUPS)}")
        if gender not in ("F", "M"):
            raise DataError(f"{path}:{number}: gender {gender!r} is not 'F' or 'M'")
        occupation = _number(path, number, occupation, "occupation")
        if not 0 <= occupation < NUM_OCCUPATIONS_1M:
            raise DataError(f"{path}:{number}: occupation {occupation} is outside 0..{NUM_OCCUPATIONS_1M - 1}")
        _put(users, _number(path, number, uid, "user id"),
             User(age, AGE_GROUPS[age][1], gender, str(occupation), zip_code), path, number, "user id")
    movies: dict[int, Movie] = {}
    path = directory / "movies.dat"
    for number, line in _lines(path, "latin-1"):
        mid, title, genres = _fields(path, number, line, "::", 3, "MovieID::Title::Genres")
        _put(movies, _number(path, number, mid, "movie id"),
             Movie(title, tuple(g for g in genres.split("|") if g), _year_from_title(title)),
             path, number, "movie id")
    return MovieLensTables("1m", user_ids, item_ids, ratings, times, users, movies, lines, blank)


def _csv_rows(path: pathlib.Path, f):
    """(1-based line number, fields) of an open CSV file; a file that is no CSV text is a DataError naming it."""
    reader = csv.reader(f)
    try:
        for row in reader:
            yield reader.line_num, row
    except csv.Error as error:  # the line the reader was on (it counts each line it fetches)
        raise DataError(f"{path}:{reader.line_num}: cannot be read as CSV ({error}); is this the MovieLens file it is "
                        "named after?") from None
    except UnicodeDecodeError as error:  # decoded ahead of the reader, a block at a time: no exact line
        where = f" after line {reader.line_num}" if reader.line_num else ""
        raise DataError(f"{path}: not UTF-8 text{where} ({error.reason}); is this the MovieLens file it is named "
                        "after?") from None


def _read_latest_small(directory: pathlib.Path) -> MovieLensTables:
    user_ids, item_ids, ratings, times, lines, blank = _read_ratings(directory / "ratings.csv", ",",
                                                                     header="userId,movieId,rating,timestamp")
    movies: dict[int, Movie] = {}
    path = directory / "movies.csv"
    with path.open(encoding="utf-8", newline="") as f:
        # Titles are quoted when they contain commas, so this file needs a real CSV reader.
        for number, row in _csv_rows(path, f):
            if number == 1:
                if row != ["movieId", "title", "genres"]:
                    raise DataError(f"{path}:1: expected the header 'movieId,title,genres', got {','.join(row)!r}")
                continue
            if not row:
                continue
            if len(row) != 3:
                raise DataError(f"{path}:{number}: expected 3 CSV fields (movieId,title,genres), got {len(row)}: "
                                 f"{row!r}")
            mid, title, genres = row
            names = tuple(g for g in genres.split("|") if g and g != NO_GENRES)
            _put(movies, _number(path, number, mid, "movie id"), Movie(title, names, _year_from_title(title)),
                 path, number, "movie id")
    return MovieLensTables("latest-small", user_ids, item_ids, ratings, times, None, movies, lines, blank)


def read_movielens(directory: str | pathlib.Path, variant: str = "auto") -> MovieLensTables:
    """Parse the files of one MovieLens variant (detected when "auto")."""
    variant = detect_variant(directory, variant)
    reader = {"100k": _read_100k, "1m": _read_1m, "latest-small": _read_latest_small}[variant]
    return reader(pathlib.Path(directory).expanduser())


# --------------------------------------------------------------------------------------------- features
def _standardise(x: np.ndarray) -> np.ndarray:
    """(x - mean) / std over the known values; unknown (nan) entries become 0, the mean."""
    known = x[np.isfinite(x)]
    if known.size == 0:
        return np.zeros_like(x)
    std = known.std()
    z = (x - known.mean()) / (std if std > 0 else 1.0)
    return np.where(np.isfinite(z), z, 0.0)


def _index(values: list, vocab: list) -> np.ndarray:
    position = {v: i for i, v in enumerate(vocab)}
    return np.asarray([position[v] for v in values], np.int32)


def prepare_examples(tables: MovieLensTables, *, rating_threshold: float = 4.0, zip_prefix_length: int = 3,
                     target: str = "binary", feature_set: str = "all") -> tuple[DatasetSpec, Batch, dict]:
    """All ratings as one Batch (file order) with its spec, and per-feature vocabularies for inspection.

    Returns (spec, batch, vocabularies) where batch holds dense f32[N, num_dense], ids {feature: i32[N, L]},
    lengths {feature: i32[N]}, labels f32[N] (`target` "binary": rating >= rating_threshold; "rating": the stars)
    and vocabularies maps each sparse feature to its id -> value list. `features` "user_item" keeps the user and
    item ids only (no dense features): `feature_set` is config.features.
    """
    if zip_prefix_length < 1:
        raise ValueError(f"zip_prefix_length must be >= 1, got {zip_prefix_length}")
    if target not in TARGETS:
        raise ConfigError("data.target", f"unknown MovieLens target {target!r}; use one of {list(TARGETS)}")
    if feature_set not in FEATURE_SETS:
        raise ConfigError("data.features", f"unknown MovieLens feature set {feature_set!r}; use one of "
                                           f"{list(FEATURE_SETS)}")
    raw_users = np.unique(tables.user_ids)  # sorted: the dense index follows the raw-id order
    raw_items = np.unique(tables.item_ids)
    user_index = np.searchsorted(raw_users, tables.user_ids).astype(np.int32)
    item_index = np.searchsorted(raw_items, tables.item_ids).astype(np.int32)
    unknown = sorted(set(raw_items.tolist()) - set(tables.movies))
    if unknown:
        raise DataError(f"MovieLens {tables.variant}: {len(unknown)} rated movie ids are not in the movies file, "
                         f"e.g. {unknown[:5]}; the ratings and movies files must come from the same download")
    movies = [tables.movies[int(m)] for m in raw_items]
    n = tables.ratings.shape[0]

    # Per-entity features first (one row per user / item), then one gather by the ratings' indices.
    per_user: dict[str, tuple[np.ndarray, list]] = {}  # feature -> (i32[U] ids, vocabulary)
    dense_user = []
    if tables.users is not None:
        missing = sorted(set(raw_users.tolist()) - set(tables.users))
        if missing:
            raise DataError(f"MovieLens {tables.variant}: {len(missing)} rating users are not in the users file, "
                             f"e.g. {missing[:5]}; the ratings and users files must come from the same download")
        users = [tables.users[int(u)] for u in raw_users]
        zips = [u.zip_code[:zip_prefix_length].upper() for u in users]
        occupations = [u.occupation for u in users]
        occupation_vocab = ([str(i) for i in range(NUM_OCCUPATIONS_1M)] if tables.variant == "1m"
                            else sorted(set(occupations)))
        for name, values, vocab in (("age_bucket", [u.age_group for u in users], sorted(AGE_GROUPS)),
                                    ("gender", [u.gender for u in users], ["F", "M"]),
                                    ("occupation", occupations, occupation_vocab),
                                    ("zip_prefix", zips, sorted(set(zips)))):
            per_user[name] = (_index(values, vocab), vocab)
        dense_user.append(("age", _standardise(np.asarray([u.age for u in users], np.float64))))

    genre_vocab = list(GENRES_100K) if tables.variant == "100k" else sorted({g for m in movies for g in m.genres})
    genre_position = {g: i for i, g in enumerate(genre_vocab)}
    bag_size = max(1, max(len(m.genres) for m in movies))
    item_genres = np.zeros((len(movies), bag_size), np.int32)
    item_genre_counts = np.asarray([len(m.genres) for m in movies], np.int32)
    for row, movie in enumerate(movies):
        item_genres[row, :len(movie.genres)] = [genre_position[g] for g in movie.genres]
    dense_item = [("release_year", _standardise(np.asarray([m.year for m in movies], np.float64)))]

    features = [FeatureSpec("user", len(raw_users)), FeatureSpec("item", len(raw_items))]
    ids = {"user": user_index[:, None], "item": item_index[:, None]}
    vocabularies = {"user": raw_users.tolist(), "item": raw_items.tolist()}
    for name, (entity_ids, vocab) in per_user.items():
        features.append(FeatureSpec(name, len(vocab)))
        ids[name] = entity_ids[user_index][:, None]
        vocabularies[name] = list(vocab)
    features.append(FeatureSpec("genres", max(1, len(genre_vocab)), bag_size))
    ids["genres"] = item_genres[item_index]
    vocabularies["genres"] = genre_vocab
    lengths = {name: np.ones(n, np.int32) for name in ids}
    lengths["genres"] = item_genre_counts[item_index]

    dense_columns = [(name, z[item_index]) for name, z in dense_item] + [(name, z[user_index])
                                                                         for name, z in dense_user]
    if feature_set == "user_item":  # collaborative filtering: the two ids, nothing else
        features, dense_columns = features[:2], []
        ids, lengths = {k: ids[k] for k in ("user", "item")}, {k: lengths[k] for k in ("user", "item")}
        vocabularies = {k: vocabularies[k] for k in ("user", "item")}
    dense = (np.stack([c for _, c in dense_columns], axis=1) if dense_columns else np.zeros((n, 0))).astype(
        np.float32)
    spec = DatasetSpec(num_dense=dense.shape[1], features=tuple(features),
                       target="regression" if target == "rating" else "binary")
    labels = (tables.ratings.astype(np.float32) if target == "rating"
              else (tables.ratings >= rating_threshold).astype(np.float32))
    batch = Batch(dense=dense, ids={k: np.ascontiguousarray(v, np.int32) for k, v in ids.items()}, lengths=lengths,
                  labels=labels)
    vocabularies["dense"] = [name for name, _ in dense_columns]
    return spec, batch, vocabularies


def split_indices(timestamps: np.ndarray, method: str, validation_fraction: float, test_fraction: float,
                  seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sorted (train, validation, test) example indices; `timestamps` i64[N] is used by the time split only.

    random: one seeded permutation; its first round(test_fraction N) ratings are test, the next
            round(validation_fraction N) validation. time: the latest ratings are test, the ones just before them
            validation (ties by file order), so both lie in train's future.
    """
    n = timestamps.shape[0]
    for key, fraction in (("validation_fraction", validation_fraction), ("test_fraction", test_fraction)):
        if not 0.0 < fraction < 1.0:
            raise ConfigError(f"data.split.{key}", f"must be in (0, 1), got {fraction}")
    n_test, n_validation = round(test_fraction * n), round(validation_fraction * n)
    if n_test < 1 or n_validation < 1 or n_test + n_validation >= n:
        need = max(math.ceil(0.5 / min(validation_fraction, test_fraction)), 3)  # round(f * n) >= 1 for both
        raise DataError(f"MovieLens: {n} ratings cannot be split into train, validation ({validation_fraction}) and "
                        f"test ({test_fraction}) with at least one rating each; these fractions need >= {need} "
                        "ratings: add ratings or raise data.split's fractions")
    if method == "random":
        order = np.random.default_rng([seed, 0x4D4C]).permutation(n)
    elif method == "time":
        order = np.lexsort((np.arange(n), timestamps))[::-1]  # latest first; ties: the later line first
    else:
        raise ConfigError("data.split.method", f"unknown MovieLens split '{method}'; use 'random' or 'time'")
    part = np.zeros(n, np.int8)  # 0 train, 1 validation, 2 test
    part[order[:n_test]] = 2
    part[order[n_test:n_test + n_validation]] = 1
    return np.flatnonzero(part == 0), np.flatnonzero(part == 1), np.flatnonzero(part == 2)


def movielens_dataset(config: ml_collections.ConfigDict, seed: int = 0) -> ArrayDataset:
    """The dataset described by `config.data` (dir, variant, rating_threshold, zip_prefix_length, and split:
    method, validation_fraction, test_fraction, seed); `seed` orders the training examples."""
    tables = read_movielens(config.dir, config.variant)
    # The prepared data's options leave out the default target and feature set (builders.movielens_options keeps the
    # cache key of data prepared before either existed), so a missing one is the default.
    target, features = config.get("target", TARGETS[0]), config.get("features", FEATURE_SETS[0])
    spec, examples, vocabularies = prepare_examples(tables, rating_threshold=float(config.rating_threshold),
                                                    zip_prefix_length=int(config.zip_prefix_length),
                                                    target=target, feature_set=features)
    label_mean = "mean_rating" if target == "rating" else "positive_rate"
    split = dict(config.split)
    try:
        indices = split_indices(tables.timestamps, split["method"], float(split["validation_fraction"]),
                                float(split["test_fraction"]), int(split["seed"]))
    except DataError as error:
        ratings_file = pathlib.Path(config.dir) / VARIANT_FILES[tables.variant][0]
        raise DataError(f"{ratings_file}: {error}") from None
    splits = {name: take(examples, index) for name, index in zip(SPLITS, indices, strict=True)}
    info = {
        "dataset": f"movielens-{tables.variant}",
        "variant": tables.variant,
        "split": split,
        "target": target,
        "rating_threshold": float(config.rating_threshold),
        "num_ratings": int(examples.size),
        "num_users": len(vocabularies["user"]),
        "num_items": len(vocabularies["item"]),
        # binary: the share of positives; rating: the mean rating
        label_mean: float(examples.labels.mean(dtype=np.float64)),
        **{f"{name}_{label_mean}": float(splits[name].labels.mean(dtype=np.float64)) for name in SPLITS},
        "dense_features": vocabularies.get("dense", []),
        "vocab_sizes": {f.name: f.vocab_size for f in spec.features},
        # MovieLens files are parsed strictly (a bad line is an error naming file and line), so nothing is skipped
        # but blank lines.
        "parse_report": {"lines_read": tables.ratings_lines, "rows_kept": int(examples.size), "skipped": 0,
                         "blank_lines": tables.blank_lines, "first_skipped": [], "empty_files": [],
                         "truncated_files": []},
    }
    return ArrayDataset(spec, splits, seed=seed, info=info)
