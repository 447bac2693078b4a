r"""Write a synthetic MovieLens-1M stand-in: `ratings.dat`, `users.dat`, `movies.dat` in ML-1M's `::` format.

    python -m experiments.make_movielens_like --out=/tmp/ml1m_like            # 6,040 users, 3,883 movies, 500k
    python -m experiments.sweep_compression --dataset=movielens --data_dir=/tmp/ml1m_like ...

No MovieLens set beyond ML-100K can be downloaded here, and compression methods that decide per row (FIITED, MD)
behave differently once rows are many and their frequencies skewed, so this writes a set shaped like ML-1M
(GroupLens' README and its files' published statistics), with a known generative model so there is real signal to
learn at every level the DLRM config sees (user, item, demographics, genres, release year):

Users (`users`, 6,040 as ML-1M): gender 71.7 % M; ML-1M's 7 age groups and 21 occupations in ML-1M's proportions;
  5-digit zip codes whose ZIP3 prefixes (the `zip_prefix` feature) follow a Zipf law over ~900 prefixes.
Movies (`movies`, 3,883 as ML-1M): a release year skewed to the 1990s (1919-2000, in the title as "(1995)");
  1-6 of ML-1M's 18 genres, drawn with ML-1M's genre frequencies.
Activity: every user rates at least `min_user_ratings` (20, ML-1M's floor) movies, the rest lognormal (sigma
  `activity_sigma` 1.2), at most `max_user_share` (62 %, ML-1M's heaviest user) of the movies: median 52, mean 83,
  most 2,408 ratings per user (ML-1M at twice the ratings: 96 / 166 / 2,314). Which movies is a Gumbel top-k draw
  without replacement per user, log-weight = log popularity + `watch_bias` (0.5) x affinity: popularity is
  Zipf-Mandelbrot (rank + `popularity_offset` 100)^-`popularity_exponent` 1.5 in a random movie order (median 41,
  most 2,383 ratings per movie: ML-1M's most rated movie has 3,428 of 1M), and users watch more of what they like
  (the missing-not-at-random selection of real rating data).
Ratings: score = b_user + b_item + <p_user, q_item> + noise, cut into 1-5 stars at the quantiles of ML-1M's star
  shares (5.6 / 10.8 / 26.1 / 34.9 / 22.6 %, so 57.5 % are >= 4, the positive label); with
    q_item = mean of its genres' vectors + item-specific factors N(0, `item_scale` 0.35),
    p_user = vectors of the user's age group, gender and occupation + user-specific factors N(0, `user_scale` 0.35),
    b_user: N(0, `user_bias` 0.6) + an age-group and zip-prefix (region) offset,
    b_item: N(0, `item_bias` 0.6) + `popularity_bias` (0.25) x z(log popularity) + 0.05 per decade before 2000,
  in `factors` (8) dimensions. The user- and item-specific parts are what only the `user` / `item` embedding rows
  can learn (hashing mixes them, FIITED decides how many dimensions each row keeps); the demographic and genre
  parts are learnable from the small tables and the multi-hot genres. `noise` (N(0, 1.1)) sets the label noise:
  the summary line reports the AUC of the noise-free score (the Bayes AUC of the >= 4 label given the generating
  variables), 0.869 with the defaults; DLRM (dlrm_movielens.py) reaches 0.825 test AUC on it (0.791 on ML-100K).
  The biases carry about as much variance as the interaction (0.8 vs 1.0), as in real ratings, where user and item
  biases explain much of what a factor model explains.

Timestamps: each user rates in a burst starting at a uniform time between ML-1M's first and last day (April 2000
- February 2003) and lasting a lognormal number of hours (most ML-1M users rated in one sitting or a few). Like
ML-1M's, ratings.dat lists each user's ratings together, in time order.

The output is a pure function of the flags (`--seed`); the script prints one JSON line with the set's statistics
(ratings, users and movies rated, positive share, ratings per user and per movie: min / median / mean / max, the
share of movies rated fewer than 10 times, Bayes AUC) and writes nothing but the three files into --out (never the
repository: data stays outside it).
"""

import json
import math
import pathlib
from collections.abc import Sequence

import numpy as np
from absl import flags

from recjax import cli, metrics

# ML-1M's README: age codes, occupations 0..20, the 18 genres; proportions from its users.dat / movies.dat.
AGE_CODES = (1, 18, 25, 35, 45, 50, 56)
AGE_SHARES = (222, 1103, 2096, 1193, 550, 496, 380)  # users per age group in ML-1M
OCCUPATION_SHARES = (711, 528, 267, 173, 759, 112, 236, 679, 17, 92, 195, 129, 388, 142, 302, 144, 241, 502, 70,
                     72, 281)  # users per occupation code 0..20 in ML-1M
GENRES = ("Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama", "Fantasy",
          "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western")
GENRE_SHARES = (503, 283, 105, 251, 1200, 211, 127, 1603, 68, 44, 343, 114, 106, 471, 276, 492, 143, 68)
GENRES_PER_MOVIE = (0.55, 0.30, 0.11, 0.03, 0.007, 0.003)  # 1..6 genres
STAR_SHARES = (0.056, 0.108, 0.261, 0.349, 0.226)  # ML-1M's 1..5 stars
FIRST_TIME, LAST_TIME = 956_703_932, 1_046_454_590  # ML-1M's first and last timestamps
ZIP3_PREFIXES = 900

DEFAULTS = {"users": 6_040, "movies": 3_883, "ratings": 500_000, "min_user_ratings": 20, "activity_sigma": 1.2,
            "max_user_share": 0.62, "popularity_exponent": 1.5, "popularity_offset": 100.0, "watch_bias": 0.5,
            "factors": 8, "user_scale": 0.35, "item_scale": 0.35, "user_bias": 0.6, "item_bias": 0.6,
            "popularity_bias": 0.25, "noise": 1.1}


def _activity(rng: np.random.Generator, users: int, ratings: int, movies: int, minimum: int, sigma: float,
              max_share: float) -> np.ndarray:
    """i64[users] ratings per user: `minimum` + lognormal(sigma) scaled so they sum to `ratings`, each user at most
    `max_share` of the movies (ML-1M's heaviest user rated 62 % of the rated movies)."""
    most = max(minimum, min(movies, math.ceil(max_share * movies)))
    if not users * minimum <= ratings <= users * most:
        raise ValueError(f"ratings {ratings} must be in [users x min_user_ratings, users x max_user_share x movies] "
                         f"= [{users * minimum}, {users * most}]")
    extra = rng.lognormal(0.0, sigma, users)
    cap, want, scale = most - minimum, ratings - users * minimum, 1.0
    for _ in range(60):  # the cap makes the total concave in the scale: fixed-point iteration converges from below
        scale *= want / max(np.minimum(extra * scale, cap).sum(), 1e-9)
    counts = minimum + np.minimum(np.floor(extra * scale), cap).astype(np.int64)
    room = np.flatnonzero(counts < most)  # hand out the rounding remainder to users with room, heaviest first
    counts[room[np.argsort(-extra[room], kind="stable")][:ratings - counts.sum()]] += 1
    return counts


def generate(seed: int = 0, **overrides) -> tuple[dict[str, list[str]], dict]:
    """({file name: lines}, statistics) of a synthetic ML-1M-format set; `overrides` replace DEFAULTS."""
    unknown = sorted(set(overrides) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown}; choose from {sorted(DEFAULTS)}")
    p = {**DEFAULTS, **overrides}
    n_users, n_movies, k = int(p["users"]), int(p["movies"]), int(p["factors"])
    if n_users < 1 or n_movies < int(p["min_user_ratings"]) or k < 1:
        raise ValueError(f"need users >= 1, movies >= min_user_ratings and factors >= 1; got {p}")
    rng = np.random.default_rng(seed)

    # Users: demographics in ML-1M's proportions, zip codes under a Zipf law of ZIP3 prefixes.
    gender = rng.random(n_users) < 0.717  # True: M
    age = rng.choice(len(AGE_CODES), n_users, p=np.asarray(AGE_SHARES) / sum(AGE_SHARES))
    occupation = rng.choice(len(OCCUPATION_SHARES), n_users, p=np.asarray(OCCUPATION_SHARES) / sum(OCCUPATION_SHARES))
    prefixes = rng.permutation(1000)[:ZIP3_PREFIXES]
    zip_weights = 1.0 / np.arange(1, ZIP3_PREFIXES + 1)
    zip_index = rng.choice(ZIP3_PREFIXES, n_users, p=zip_weights / zip_weights.sum())
    zips = [f"{prefixes[z]:03d}{rng.integers(100):02d}" for z in zip_index]

    # Movies: years skewed to the 1990s, 1-6 genres with ML-1M's frequencies.
    years = np.clip(2000 - np.floor(rng.exponential(8.0, n_movies)), 1919, 2000).astype(np.int64)
    genre_p = np.asarray(GENRE_SHARES, np.float64) / sum(GENRE_SHARES)
    genre_count = rng.choice(len(GENRES_PER_MOVIE), n_movies, p=np.asarray(GENRES_PER_MOVIE) / sum(GENRES_PER_MOVIE))
    movie_genres = [np.sort(rng.choice(len(GENRES), c + 1, replace=False, p=genre_p)) for c in genre_count]

    # Latent factors: q_item = its genres' mean + its own part; p_user = its demographics + its own part.
    genre_vec = rng.normal(0.0, 0.5, (len(GENRES), k))
    q = np.stack([genre_vec[g].mean(axis=0) for g in movie_genres]) + rng.normal(0.0, p["item_scale"], (n_movies, k))
    age_vec, gender_vec = rng.normal(0.0, 0.35, (len(AGE_CODES), k)), rng.normal(0.0, 0.35, (2, k))
    occupation_vec = rng.normal(0.0, 0.25, (len(OCCUPATION_SHARES), k))
    pu = age_vec[age] + gender_vec[gender.astype(int)] + occupation_vec[occupation] + rng.normal(
        0.0, p["user_scale"], (n_users, k))
    affinity = pu @ q.T  # f64[U, M]

    # Popularity: Zipf in a random movie order; who watches what: Gumbel top-k of log popularity + bias x affinity.
    popularity = np.empty(n_movies)
    popularity[rng.permutation(n_movies)] = (np.arange(1, n_movies + 1, dtype=np.float64)
                                             + p["popularity_offset"]) ** -p["popularity_exponent"]
    counts = _activity(rng, n_users, int(p["ratings"]), n_movies, int(p["min_user_ratings"]), p["activity_sigma"],
                       p["max_user_share"])
    logits = np.log(popularity)[None, :] + p["watch_bias"] * affinity
    user_of, movie_of = [], []
    for u in range(n_users):
        keys = logits[u] + rng.gumbel(size=n_movies)
        chosen = np.argpartition(-keys, counts[u] - 1)[:counts[u]]
        user_of.append(np.full(counts[u], u))
        movie_of.append(np.sort(chosen))
    user_of, movie_of = np.concatenate(user_of), np.concatenate(movie_of)

    # Scores: biases (age group, region, popularity, age of the film) + affinity + noise, cut at ML-1M's star shares.
    region = rng.normal(0.0, 0.15, ZIP3_PREFIXES)
    b_user = rng.normal(0.0, p["user_bias"], n_users) + np.linspace(-0.15, 0.15, len(AGE_CODES))[age] + region[
        zip_index]
    log_pop = np.log(popularity)
    b_item = (rng.normal(0.0, p["item_bias"], n_movies) + p["popularity_bias"] * (log_pop - log_pop.mean())
              / log_pop.std() + 0.05 * (2000 - years) / 10)
    clean = b_user[user_of] + b_item[movie_of] + affinity[user_of, movie_of]
    score = clean + rng.normal(0.0, p["noise"], clean.shape[0])
    cuts = np.quantile(score, np.cumsum(STAR_SHARES)[:-1])
    stars = 1 + np.searchsorted(cuts, score, side="right")

    # Timestamps: one burst per user.
    start = rng.integers(FIRST_TIME, LAST_TIME, n_users)
    length = np.exp(rng.normal(math.log(2 * 3600), 2.0, n_users))  # seconds; median 2 hours, heavy tail
    times = np.minimum(start[user_of] + (rng.random(user_of.shape[0]) * length[user_of]).astype(np.int64),
                       LAST_TIME)
    order = np.lexsort((times, user_of))  # ML-1M's ratings.dat is grouped by user

    # Files: ids from 1 as in ML-1M; every movie is listed, rated or not (ML-1M lists 3,883 and 3,706 are rated).
    ratings_lines = [f"{u + 1}::{m + 1}::{s}::{t}" for u, m, s, t in
                     zip(user_of[order], movie_of[order], stars[order], times[order], strict=True)]
    users_lines = [f"{u + 1}::{'M' if gender[u] else 'F'}::{AGE_CODES[age[u]]}::{occupation[u]}::{zips[u]}"
                   for u in range(n_users)]
    movies_lines = [f"{m + 1}::Movie {m + 1} ({years[m]})::{'|'.join(GENRES[g] for g in movie_genres[m])}"
                    for m in range(n_movies)]
    per_movie = np.bincount(movie_of, minlength=n_movies)
    rated = per_movie[per_movie > 0]
    label = stars >= 4
    stats = {"seed": seed, **p, "ratings_written": int(user_of.shape[0]), "users_rated": int(n_users),
             "movies_rated": int(rated.shape[0]), "positive_share": round(float(label.mean()), 4),
             "ratings_per_user": _spread(counts), "ratings_per_movie": _spread(rated),
             "movies_rated_under_10": round(float((rated < 10).mean()), 4),
             "bayes_auc": round(metrics.auc(label, clean), 4)}
    return {"ratings.dat": ratings_lines, "users.dat": users_lines, "movies.dat": movies_lines}, stats


def _spread(x: np.ndarray) -> dict[str, float]:
    return {"min": int(x.min()), "median": float(np.median(x)), "mean": round(float(x.mean()), 1), "max": int(x.max())}


def write(out: str | pathlib.Path, seed: int = 0, **overrides) -> dict:
    """Generate and write the three files into `out` (created); returns the statistics."""
    out = pathlib.Path(out)
    files, stats = generate(seed, **overrides)
    out.mkdir(parents=True, exist_ok=True)
    for name, lines in files.items():
        (out / name).write_text("\n".join(lines) + "\n", encoding="latin-1")
    return stats


def define_flags() -> None:
    flags.DEFINE_string("out", None, "Folder to write ratings.dat, users.dat and movies.dat into (created).")
    flags.DEFINE_integer("seed", 0, "Seeds everything the set is drawn from.")
    for name, value in DEFAULTS.items():
        if isinstance(value, int):
            flags.DEFINE_integer(name, value, f"Generator parameter (default {value}); see the module docstring.")
        else:
            flags.DEFINE_float(name, value, f"Generator parameter (default {value}); see the module docstring.")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        cli.fail(f"unexpected arguments: {argv[1:]}")
    args = flags.FLAGS
    if not args.out:
        cli.fail("--out: give the folder to write the files into (outside the repository)")
    try:
        stats = write(args.out, args.seed, **{name: getattr(args, name) for name in DEFAULTS})
    except ValueError as e:
        cli.fail(str(e))
    print(json.dumps({"out": str(pathlib.Path(args.out).resolve()), **stats}))


if __name__ == "__main__":
    define_flags()
    cli.run(main)
