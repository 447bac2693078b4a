"""Criteo parser and preprocessing against a plain-Python line-by-line oracle, brute-force counts, the shared sample.

The real sample (first 1,999 lines of the Kaggle train.txt) is read from the shared data directory
($RECJAX_SHARED_DATA, else <repo>/../shared/data) and never copied into the repository.
"""

import ast
import collections
import dataclasses
import gzip
import json
import math
import os
import pathlib
import re
import zlib

import numpy as np
import pytest

from recjax.batch import validate_batch
from recjax.data import criteo
from recjax.data.arrays import concatenate

SHARED_DATA = pathlib.Path(os.environ.get("RECJAX_SHARED_DATA")
                           or pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data")
SAMPLE = SHARED_DATA / "criteo_kaggle_sample" / "train.txt"
needs_sample = pytest.mark.skipif(not SAMPLE.exists(), reason=f"Criteo Kaggle sample not found at {SAMPLE} "
                                  "(set RECJAX_SHARED_DATA to the shared data directory)")
MISSING = 2**32
SMALL_CHUNK = 1024  # the minimum: many blocks even for small test files


# ----------------------------------------------------------------------------------------------------------------------
# Oracle: the grammar of the module doc, one line at a time in plain Python
# ----------------------------------------------------------------------------------------------------------------------

DENSE_RE = re.compile(rb"-?[0-9]+")
HEX_RE = re.compile(rb"[0-9a-fA-F]{8}")


def dense_ok(field: bytes) -> bool:
    return field == b"" or (DENSE_RE.fullmatch(field) is not None and len(field) <= 20
                            and -(2**63) <= int(field) < 2**63)


def reference_parse(data: bytes, first_line: int = 1):
    """(rows [(line, label, dense[13] float64, cats[26])], bad line numbers, blank line numbers)."""
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    rows, bad, blank = [], [], []
    for number, line in enumerate(lines, first_line):
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line:
            blank.append(number)
            continue
        fields = line.split(b"\t")
        ok = (b"\r" not in line and len(fields) == 40 and fields[0] in (b"0", b"1")
              and all(dense_ok(f) for f in fields[1:14])
              and all(f == b"" or HEX_RE.fullmatch(f) for f in fields[14:]))
        if not ok:
            bad.append(number)
            continue
        dense = [math.log1p(max(int(f), 0)) if f else 0.0 for f in fields[1:14]]
        cats = [int(f, 16) if f else MISSING for f in fields[14:]]
        rows.append((number, int(fields[0]), dense, cats))
    return rows, bad, blank


def parse_all(path, **kwargs):
    report = criteo.ParseReport()
    chunks = list(criteo.parse_file(path, report=report, **kwargs))
    return chunks, report


def line_numbers(chunks) -> list[int]:
    return [n for chunk in chunks for n in chunk.line_numbers.tolist()]


def assert_matches_reference(chunks, report, expected):
    rows, bad, blank = expected
    lines = np.concatenate([c.line_numbers for c in chunks])
    assert lines.tolist() == [r[0] for r in rows]
    assert np.concatenate([c.labels for c in chunks]).tolist() == [r[1] for r in rows]
    expected_dense = np.array([r[2] for r in rows]).reshape(-1, 13)
    np.testing.assert_allclose(np.concatenate([c.dense for c in chunks]), expected_dense, rtol=1e-6, atol=1e-6)
    assert np.concatenate([c.cats for c in chunks]).tolist() == [r[3] for r in rows]
    assert report.skipped == len(bad)
    assert [n for _, n, _ in report.first_skipped] == bad[:criteo.MAX_REPORTED]
    assert report.blank_lines == len(blank)
    assert report.rows_kept == len(rows)
    assert all("vectorised parser" not in r for _, _, r in report.first_skipped)  # the explainer agrees


# ----------------------------------------------------------------------------------------------------------------------
# Generated lines
# ----------------------------------------------------------------------------------------------------------------------

GOOD_DENSE = [b"", b"0", b"1", b"7", b"42", b"-1", b"-3", b"1382", b"12345678", b"-1234567", b"123456789",
              b"98765432101", b"007", b"9223372036854775807", b"-9223372036854775808", b"00000000000000000001",
              b"-0", b"1000000000000000000"]
BAD_DENSE = [b"1.5", b"1e3", b"+5", b" 5", b"5 ", b"-", b"--1", b"abc", b"9223372036854775808",
             b"-9223372036854775809", b"99999999999999999999", b"000000000000000000001", b"12345678\x00", b"\xff",
             b"1-2", b"123456789a"]
BAD_HEX = [b"68fd1e6", b"68fd1e644", b"68fd1e6g", b"68fd 1e6", b"xyzxyzxy", b"68fd1e6\xff", b"-8fd1e64", b"0x12ab34"]


def random_line(rng: np.random.Generator) -> bytes:
    label = b"1" if rng.random() < 0.3 else b"0"
    dense = [GOOD_DENSE[i] for i in rng.integers(0, len(GOOD_DENSE), 13)]
    cats = []
    for _ in range(26):
        if rng.random() < 0.1:
            cats.append(b"")
        else:
            text = f"{int(rng.integers(0, 2**32)):08x}"
            cats.append((text.upper() if rng.random() < 0.1 else text).encode())
    return b"\t".join([label] + dense + cats)


def corrupt(line: bytes, rng: np.random.Generator) -> bytes:
    """A bad version of a good line (one of the failure kinds of the module doc)."""
    fields = line.split(b"\t")
    kind = rng.integers(0, 8)
    if kind == 0:
        fields[0] = [b"2", b"", b"01", b"a", b"-1"][rng.integers(0, 5)]
    elif kind == 1:
        fields[1 + rng.integers(0, 13)] = BAD_DENSE[rng.integers(0, len(BAD_DENSE))]
    elif kind == 2:
        fields[14 + rng.integers(0, 26)] = BAD_HEX[rng.integers(0, len(BAD_HEX))]
    elif kind == 3:
        del fields[rng.integers(0, 40)]
    elif kind == 4:
        fields.insert(rng.integers(0, 40), b"1")
    elif kind == 5:
        i = rng.integers(0, 40)
        fields[i] = fields[i] + b"\r"
    elif kind == 6:
        return line[:rng.integers(1, len(line) - 1)]  # truncated mid-line
    else:
        return b"\t".join(fields[:39]) + b"\t\t"  # 41 fields, last ones empty
    return b"\t".join(fields)


def generated_text(n: int, seed: int = 0, bad_fraction: float = 0.1, blank_fraction: float = 0.02,
                   crlf: bool = False) -> bytes:
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        u = rng.random()
        if u < blank_fraction:
            lines.append(b"")
        elif u < blank_fraction + bad_fraction:
            lines.append(corrupt(random_line(rng), rng))
        else:
            lines.append(random_line(rng))
    end = b"\r\n" if crlf else b"\n"
    return end.join(lines) + end


def write(tmp_path: pathlib.Path, name: str, data: bytes) -> pathlib.Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


# ----------------------------------------------------------------------------------------------------------------------
# The real sample
# ----------------------------------------------------------------------------------------------------------------------


@needs_sample
def test_sample_prepares_to_1999_rows_with_418_positives():
    dataset = criteo.criteo_array_dataset(SAMPLE)
    sizes = {name: batch.size for name, batch in dataset.splits.items()}
    # 1999 = 7 * 285 + 4: days 0-3 have 286 lines, days 4-6 285; day 6 -> test 143 (ceil), validation 142.
    assert sizes == {"train": 4 * 286 + 2 * 285, "validation": 142, "test": 143}
    assert sum(float(b.labels.sum()) for b in dataset.splits.values()) == 418
    info = dataset.info()
    assert info["parse_report"]["rows_kept"] == 1999 and info["parse_report"]["skipped"] == 0
    assert info["parse_report"]["lines_read"] == 1999
    json.dumps(info)  # the run summary can carry it
    for batch in dataset.splits.values():
        validate_batch(batch, dataset.spec)
    assert sorted(dataset.splits) == ["test", "train", "validation"]


@needs_sample
def test_sample_hand_checked_first_row():
    # Line 1 of the file, read by eye: 0 | 1 1 5 0 1382 4 15 2 181 1 2 (empty) 2 | 68fd1e64 80e26c9b ... (CRLF ends).
    chunk = next(criteo.parse_file(SAMPLE))
    assert chunk.line_numbers[0] == 1 and chunk.labels[0] == 0.0
    raw_dense = [1, 1, 5, 0, 1382, 4, 15, 2, 181, 1, 2, 0, 2]
    np.testing.assert_allclose(chunk.dense[0], np.log1p(raw_dense), rtol=1e-6)
    expected_cats = ["68fd1e64", "80e26c9b", "fb936136", "7b4723c4", "25c83c98", "7e0ccccf", "de7995b8", "1f89b562",
                     "a73ee510", "a8cd5504", "b2cb9c98", "37c9c164", "2824a5f6", "1adce6ef", "8ba8b39a", "891b62e7",
                     "e5ba7672", "f54016b9", "21ddcdc9", "b1252a9d", "07b5194c", None, "3a171ecb", "c5c50484",
                     "e8b83407", "9727dd16"]
    assert chunk.cats[0].tolist() == [MISSING if h is None else int(h, 16) for h in expected_cats]


@needs_sample
@pytest.mark.parametrize("chunk_bytes,num_threads", [(criteo.DEFAULT_CHUNK_BYTES, 2), (SMALL_CHUNK * 8, 2),
                                                     (SMALL_CHUNK * 8, 1)])
def test_sample_matches_reference_parser(chunk_bytes, num_threads):
    chunks, report = parse_all(SAMPLE, chunk_bytes=chunk_bytes, num_threads=num_threads)
    assert_matches_reference(chunks, report, reference_parse(SAMPLE.read_bytes()))
    assert report.rows_kept == 1999


# ----------------------------------------------------------------------------------------------------------------------
# Generated lines: vectorised parser == the oracle
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("crlf", [False, True])
@pytest.mark.parametrize("chunk_bytes,num_threads", [(SMALL_CHUNK, 2), (SMALL_CHUNK * 16, 1), (1 << 20, 2)])
def test_generated_lines_match_reference(tmp_path, crlf, chunk_bytes, num_threads):
    data = generated_text(1500, seed=int(crlf), crlf=crlf)
    path = write(tmp_path, "train.txt", data)
    chunks, report = parse_all(path, chunk_bytes=chunk_bytes, num_threads=num_threads)
    expected = reference_parse(data)
    assert len(expected[1]) > 100 and len(expected[2]) > 10 and len(expected[0]) > 1000  # the mix is exercised
    assert_matches_reference(chunks, report, expected)
    assert report.lines_read == 1500


def test_random_byte_noise_matches_reference(tmp_path):
    # Lines with random bytes flipped to characters near the grammar's edges.
    rng = np.random.default_rng(7)
    noise = np.frombuffer(b"0189afAFgG-+ .\t\r\x00\xff/:@`", np.uint8)
    lines = []
    for _ in range(800):
        line = bytearray(random_line(rng))
        for _ in range(rng.integers(0, 3)):
            line[rng.integers(0, len(line))] = noise[rng.integers(0, noise.size)]
        lines.append(bytes(line))
    data = b"\n".join(lines) + b"\n"
    path = write(tmp_path, "noise.txt", data)
    chunks, report = parse_all(path, chunk_bytes=SMALL_CHUNK * 4)
    expected = reference_parse(data)
    assert 100 < len(expected[1]) < 700
    assert_matches_reference(chunks, report, expected)


# ----------------------------------------------------------------------------------------------------------------------
# Malformed input: strict raises naming file + line + reason; lenient skips and reports
# ----------------------------------------------------------------------------------------------------------------------

GOOD = b"1\t1\t2\t\t4\t5\t6\t7\t8\t9\t10\t11\t12\t13\t" + b"\t".join([b"0123abcd"] * 25 + [b""])
assert len(GOOD.split(b"\t")) == 40

MALFORMED = {
    "too few fields": (GOOD.rsplit(b"\t", 1)[0], "39 tab-separated fields"),
    "too many fields": (GOOD + b"\tabcdef01", "41 tab-separated fields"),
    "non-hex category": (GOOD.replace(b"0123abcd", b"0123abcz", 1), "C1 = '0123abcz' is not 8 hex digits"),
    "short category": (GOOD.replace(b"0123abcd", b"0123abc", 1), "C1 = '0123abc' is not 8 hex digits"),
    "non-integer dense": (GOOD.replace(b"\t2\t", b"\t2.5\t", 1), "I2 = '2.5' is not an integer"),
    "dense overflow": (GOOD.replace(b"\t2\t", b"\t9223372036854775808\t", 1), "I2 = '9223372036854775808' overflows"),
    "label not 0/1": (b"2" + GOOD[1:], "label '2' is not 0 or 1"),
    "stray carriage return": (GOOD.replace(b"\t5\t", b"\t5\r\t", 1), "stray carriage return"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_line_strict_and_lenient(tmp_path, case):
    bad, reason = MALFORMED[case]
    path = write(tmp_path, "day_0", b"\n".join([GOOD, GOOD, bad, GOOD]) + b"\n")
    with pytest.raises(ValueError) as error:
        list(criteo.parse_file(path, strict=True))
    message = str(error.value)
    assert str(path) in message and "line 3:" in message and reason in message, message

    chunks, report = parse_all(path)
    assert line_numbers(chunks) == [1, 2, 4]
    assert report.skipped == 1 and report.first_skipped == [(str(path), 3, report.first_skipped[0][2])]
    assert reason in report.first_skipped[0][2]
    assert report.rows_kept == 3 and report.lines_read == 4


def test_last_line_without_newline_is_valid_if_complete(tmp_path):
    path = write(tmp_path, "train.txt", GOOD + b"\n" + GOOD)
    chunks, report = parse_all(path, strict=True)
    assert line_numbers(chunks) == [1, 2] and report.skipped == 0 and report.lines_read == 2


def test_truncated_last_line_is_bad(tmp_path):
    path = write(tmp_path, "train.txt", GOOD + b"\n" + GOOD[:57])
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: line 2: .*tab-separated fields, expected 40"):
        list(criteo.parse_file(path, strict=True))
    chunks, report = parse_all(path)
    assert line_numbers(chunks) == [1] and report.skipped == 1 and report.first_skipped[0][1] == 2


def test_oversized_line_is_one_bad_line(tmp_path):
    # No newline for more than MAX_LINE_BYTES + a read (a wrong or binary file): skipped, never held in memory.
    path = write(tmp_path, "train.txt", GOOD + b"\n" + b"7" * (criteo.MAX_LINE_BYTES + 300_000) + b"\n" + GOOD + b"\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: line 2: line longer than"):
        list(criteo.parse_file(path, strict=True, chunk_bytes=SMALL_CHUNK * 64))
    chunks, report = parse_all(path, chunk_bytes=SMALL_CHUNK * 64)
    assert line_numbers(chunks) == [1, 3] and report.skipped == 1 and report.lines_read == 3


def test_crlf_and_blank_lines(tmp_path):
    data = GOOD + b"\r\n\r\n" + GOOD + b"\r\n\n" + GOOD + b"\r\n"
    path = write(tmp_path, "train.txt", data)
    chunks, report = parse_all(path, strict=True)  # blank lines are never an error
    assert line_numbers(chunks) == [1, 3, 5]
    assert report.blank_lines == 2 and report.first_blank == [(str(path), 2), (str(path), 4)]
    assert report.skipped == 0 and report.lines_read == 5
    plain, _ = parse_all(write(tmp_path, "lf.txt", GOOD + b"\n"))
    assert chunks[0].cats[0].tolist() == plain[0].cats[0].tolist()  # '\r' stripped from C26
    assert chunks[0].cats[0, -1] == MISSING


def test_empty_file(tmp_path):
    path = write(tmp_path, "day_0", b"")
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: the file is empty"):
        list(criteo.parse_file(path, strict=True))
    chunks, report = parse_all(path)
    assert chunks == [] and report.empty_files == [str(path)] and report.lines_read == 0
    with pytest.raises(ValueError, match="train split has no valid rows"):
        criteo.prepare_criteo(criteo.kaggle_splits(path))


def test_several_files_report_in_file_order(tmp_path):
    day_0 = write(tmp_path, "day_0", b"\n".join([GOOD, GOOD, GOOD[:30], GOOD]) + b"\n")
    day_1 = write(tmp_path, "day_1", b"")
    day_2 = write(tmp_path, "day_2.gz", gzip.compress(GOOD + b"\n\n" + GOOD + b"\n"))
    pieces = [criteo.FileSlice(str(p)) for p in (day_0, day_1, day_2)]
    with pytest.raises(ValueError, match=rf"{re.escape(str(day_0))}: line 3: "):
        list(criteo.parse_slices(pieces, criteo.CriteoOptions(strict=True, chunk_bytes=SMALL_CHUNK)))
    report = criteo.ParseReport()
    chunks = list(criteo.parse_slices(pieces, criteo.CriteoOptions(chunk_bytes=SMALL_CHUNK), report))
    assert [(c.path, c.line_numbers.tolist()) for c in chunks] == [(str(day_0), [1, 2, 4]), (str(day_2), [1, 3])]
    assert report.empty_files == [str(day_1)] and report.first_blank == [(str(day_2), 2)]
    assert report.lines_read == 7 and report.rows_kept == 5 and report.skipped == 1


def test_report_keeps_first_ten_and_counts_all(tmp_path):
    lines = [GOOD if i % 3 else b"1\tx" for i in range(100)]
    path = write(tmp_path, "train.txt", b"\n".join(lines) + b"\n")
    _, report = parse_all(path, chunk_bytes=SMALL_CHUNK)
    bad = [i + 1 for i in range(100) if i % 3 == 0]
    assert report.skipped == len(bad)
    assert [n for _, n, _ in report.first_skipped] == bad[:10]
    summary = report.to_dict()
    assert summary["skipped"] == 34 and len(summary["first_skipped"]) == 10
    assert "34 bad lines skipped" in report.summary()
    json.dumps(summary)


# ----------------------------------------------------------------------------------------------------------------------
# gzip
# ----------------------------------------------------------------------------------------------------------------------


def test_gzip_matches_plain_including_multiple_members(tmp_path):
    data = generated_text(1200, seed=3)
    half = data.index(b"\n", len(data) // 2) + 1
    path = write(tmp_path, "day_0.gz", gzip.compress(data[:half]) + gzip.compress(data[half:]))
    chunks, report = parse_all(path, chunk_bytes=SMALL_CHUNK * 4)
    assert_matches_reference(chunks, report, reference_parse(data))
    assert report.truncated_files == []
    assert criteo.count_lines(path) == 1200


def test_gzip_cut_short(tmp_path):
    data = generated_text(1500, seed=4, bad_fraction=0.0, blank_fraction=0.0)
    compressed = gzip.compress(data)
    path = write(tmp_path, "day_1.gz", compressed[:len(compressed) * 2 // 3])
    decoder = zlib.decompressobj(wbits=31)
    prefix = decoder.decompress(path.read_bytes()) + decoder.flush()  # what can be decoded before the cut
    assert 0 < len(prefix) < len(data) and not prefix.endswith(b"\n")
    complete = prefix[:prefix.rindex(b"\n") + 1]
    cut_line = complete.count(b"\n") + 1

    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: gzip stream ends before its end-of-stream "
                       rf"marker \(file cut short\?\) \(in line {cut_line}\)"):
        list(criteo.parse_file(path, strict=True, chunk_bytes=SMALL_CHUNK * 8))
    chunks, report = parse_all(path, chunk_bytes=SMALL_CHUNK * 8)
    rows, bad, _ = reference_parse(complete)
    assert bad == [] and report.rows_kept == len(rows) == cut_line - 1
    assert np.concatenate([c.cats for c in chunks]).tolist() == [r[3] for r in rows]
    assert report.skipped == 1 and report.first_skipped[0][1] == cut_line
    assert "incomplete last line" in report.first_skipped[0][2]
    assert [f for f, _ in report.truncated_files] == [str(path)]


def test_gzip_cut_at_a_line_end_is_still_reported(tmp_path):
    # A stream that stops cleanly after a line but has no end marker: no line is lost, the file is still flagged.
    raw = zlib.compressobj(wbits=31)
    data = b"\n".join([GOOD] * 5) + b"\n"
    path = write(tmp_path, "day_2.gz", raw.compress(data) + raw.flush(zlib.Z_SYNC_FLUSH))
    chunks, report = parse_all(path)
    assert report.rows_kept == 5 and report.skipped == 0 and len(report.truncated_files) == 1


# ----------------------------------------------------------------------------------------------------------------------
# Splits
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_lines", [7003, 7010])
def test_kaggle_split_sizes(tmp_path, num_lines):
    # Day sizes per the reference: divmod(N, 7), the first N % 7 days one longer; day 6 -> test (ceil) | validation.
    data = generated_text(num_lines, seed=5, bad_fraction=0.05, blank_fraction=0.01)
    path = write(tmp_path, "train.txt", data)
    base, extra = divmod(num_lines, 7)
    days = [base + (d < extra) for d in range(7)]
    train_lines = sum(days[:6])
    test_lines = (days[6] + 1) // 2
    expected_lines = {"train": range(1, train_lines + 1),
                      "test": range(train_lines + 1, train_lines + test_lines + 1),
                      "validation": range(train_lines + test_lines + 1, num_lines + 1)}
    rows, bad, blank = reference_parse(data)
    good_lines = [r[0] for r in rows]
    prepared = criteo.prepare_criteo(criteo.kaggle_splits(path, chunk_bytes=SMALL_CHUNK * 64),
                                     criteo.CriteoOptions(chunk_bytes=SMALL_CHUNK * 64), block_rows=1000)
    for split, lines in expected_lines.items():
        got = sum(block.size for block in prepared.blocks(split))
        assert got == sum(1 for n in good_lines if n in lines), split
        assert sum(1 for chunk in criteo.parse_slices(prepared.splits[split], prepared.options)
                   for n in chunk.line_numbers.tolist() if n not in lines) == 0
    assert prepared.report.lines_read == num_lines  # train counted once, in the fitting pass
    assert prepared.report.skipped == len(bad) and prepared.report.blank_lines == len(blank)
    list(prepared.blocks("validation"))  # a second stream of a split is not reported again
    assert prepared.report.lines_read == num_lines


def test_terabyte_splits_by_day(tmp_path):
    texts = {day: generated_text(300 + day, seed=10 + day, bad_fraction=0.0, blank_fraction=0.0) for day in range(4)}
    for day, text in texts.items():
        if day % 2:
            write(tmp_path, f"day_{day}.gz", gzip.compress(text))
        else:
            write(tmp_path, f"day_{day}", text)
    splits = criteo.terabyte_splits(tmp_path, train_days=(0, 1, 2), halved_day=3)
    prepared = criteo.prepare_criteo(splits, criteo.CriteoOptions(chunk_bytes=SMALL_CHUNK * 4), block_rows=128)
    sizes = {split: sum(b.size for b in prepared.blocks(split)) for split in ("train", "validation", "test")}
    assert sizes == {"train": 300 + 301 + 302, "test": 152, "validation": 151}  # day 3: 303 lines, ceil to test
    test_lines = np.concatenate([c.line_numbers for c in criteo.parse_slices(splits["test"], prepared.options)])
    val_lines = np.concatenate([c.line_numbers for c in criteo.parse_slices(splits["validation"], prepared.options)])
    assert test_lines.tolist() == list(range(1, 153)) and val_lines.tolist() == list(range(153, 304))

    whole = criteo.terabyte_splits(tmp_path, train_days=(0, 1), validation_days=(2,), test_days=(3,), halved_day=None)
    assert [len(whole[s]) for s in ("train", "validation", "test")] == [2, 1, 1]
    with pytest.raises(ValueError, match=r"no day_N or day_N.gz for days \[4, 5\]"):
        criteo.terabyte_splits(tmp_path, train_days=(0, 4), halved_day=5)
    with pytest.raises(ValueError, match="a day is in two splits"):
        criteo.terabyte_splits(tmp_path, train_days=(0, 3), halved_day=3)


# ----------------------------------------------------------------------------------------------------------------------
# Vocabulary, blocks, statistics
# ----------------------------------------------------------------------------------------------------------------------


def skewed_text(n: int, seed: int) -> bytes:
    """Lines whose categories repeat often (few distinct keys), so thresholds matter."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        cats = [b"" if rng.random() < 0.05 else f"{int(rng.zipf(1.5)) % 300 * 7919:08x}".encode()
                for _ in range(26)]
        dense = [str(int(v)).encode() for v in rng.integers(-2, 50, 13)]
        lines.append(b"\t".join([b"1" if rng.random() < 0.2 else b"0"] + dense + cats))
    return b"\n".join(lines) + b"\n"


def brute_force_vocabulary(train_rows, threshold):
    """Per feature {raw key: index}: keys seen >= threshold times, by descending count then ascending key, from 1."""
    vocabularies = []
    for f in range(26):
        counts = collections.Counter(r[3][f] for r in train_rows)
        kept = sorted((k for k, c in counts.items() if c >= threshold), key=lambda k: (-counts[k], k))
        vocabularies.append(({k: i + 1 for i, k in enumerate(kept)}, counts))
    return vocabularies


@pytest.mark.parametrize("threshold,spill", [(1, True), (4, True), (4, False)])
def test_frequency_vocabulary_matches_brute_force(tmp_path, threshold, spill):
    data = skewed_text(2100, seed=threshold)
    path = write(tmp_path, "train.txt", data)
    options = criteo.CriteoOptions(frequency_threshold=threshold, chunk_bytes=SMALL_CHUNK * 8, spill=spill)
    prepared = criteo.prepare_criteo(criteo.kaggle_splits(path, chunk_bytes=options.chunk_bytes), options,
                                     block_rows=256)
    rows, _, _ = reference_parse(data)
    train_rows = [r for r in rows if r[0] <= 1800]  # 2100 = 7 * 300: days 0-5 are lines 1..1800
    expected = brute_force_vocabulary(train_rows, threshold)
    for f, (index_of, counts) in enumerate(expected):
        assert prepared.spec.features[f].vocab_size == len(index_of) + 1
        index_counts = prepared.stats.index_counts[f"C{f + 1}"]
        assert index_counts[0] == sum(c for k, c in counts.items() if k not in index_of)
        assert index_counts[1:].tolist() == [counts[k] for k in sorted(index_of, key=index_of.get)]
    for split, lines in {"train": (1, 1800), "test": (1801, 1950), "validation": (1951, 2100)}.items():
        blocks = list(prepared.blocks(split))
        assert all(b.size == 256 for b in blocks[:-1]) and 0 < blocks[-1].size <= 256
        batch = concatenate(blocks)
        validate_batch(batch, prepared.spec)
        split_rows = [r for r in rows if lines[0] <= r[0] <= lines[1]]
        assert batch.labels.tolist() == [r[1] for r in split_rows]
        for f, (index_of, _) in enumerate(expected):
            assert batch.ids[f"C{f + 1}"][:, 0].tolist() == [index_of.get(r[3][f], 0) for r in split_rows]
            assert batch.lengths[f"C{f + 1}"].tolist() == [1] * len(split_rows)


def test_hash_vocabulary_matches_brute_force(tmp_path):
    data = skewed_text(700, seed=9)
    path = write(tmp_path, "train.txt", data)
    options = criteo.CriteoOptions(vocab="hash", max_index=97)
    prepared = criteo.prepare_criteo(criteo.kaggle_splits(path), options, block_rows=64)
    rows, _, _ = reference_parse(data)
    assert [f.vocab_size for f in prepared.spec.features] == [97] * 26
    batch = concatenate(list(prepared.blocks("train")))
    train_rows = [r for r in rows if r[0] <= 600]
    for f in range(26):
        expected_ids = [r[3][f] % 97 for r in train_rows]
        assert batch.ids[f"C{f + 1}"][:, 0].tolist() == expected_ids
        assert prepared.stats.index_counts[f"C{f + 1}"].tolist() == np.bincount(expected_ids, minlength=97).tolist()


def _no_literal_eval(*args):
    raise AssertionError("ast.literal_eval called while reading the data")


@pytest.mark.parametrize("vocab", ["frequency", "hash"])
def test_spilled_train_equals_parsing_again(tmp_path, vocab, monkeypatch):
    """The spilled train split equals a second parse. It is read back on 2 threads without parsing any text header
    (np.load's ast.literal_eval on several threads failed on CPython 3.11.7: textio.write_arrays)."""
    path = write(tmp_path, "train.txt", generated_text(2000, seed=13))
    blocks = {}
    for spill in (True, False):
        options = criteo.CriteoOptions(vocab=vocab, max_index=1000, chunk_bytes=SMALL_CHUNK * 16, spill=spill,
                                       spill_dir=str(tmp_path), num_threads=2)
        with criteo.prepare_criteo(criteo.kaggle_splits(path), options, block_rows=300) as prepared:
            with monkeypatch.context() as patch:
                patch.setattr(ast, "literal_eval", _no_literal_eval)
                blocks[spill] = {split: list(prepared.blocks(split)) for split in prepared.splits}
            report = prepared.report.to_dict()
        assert report["lines_read"] == 2000  # the train pass is reported once, whichever way train is streamed
    for split, spilled in blocks[True].items():
        again = blocks[False][split]
        assert [b.size for b in spilled] == [b.size for b in again]
        for a, b in zip(spilled, again, strict=True):
            np.testing.assert_array_equal(a.dense, b.dense)
            np.testing.assert_array_equal(a.labels, b.labels)
            for name in criteo.CRITEO_FEATURE_NAMES:
                np.testing.assert_array_equal(a.ids[name], b.ids[name])
    assert not list(tmp_path.glob("recjax_criteo_spill_*"))  # the context manager deleted the spill


def test_spill_is_deleted_by_close_and_on_errors(tmp_path):
    path = write(tmp_path, "train.txt", b"\n".join([GOOD] * 50 + [b"1\tbad"] + [GOOD] * 20) + b"\n")
    options = criteo.CriteoOptions(spill_dir=str(tmp_path), chunk_bytes=SMALL_CHUNK)
    prepared = criteo.prepare_criteo(criteo.kaggle_splits(path), options)
    assert len(list(tmp_path.glob("recjax_criteo_spill_*/chunk_*.bin"))) > 1
    prepared.close()
    assert not list(tmp_path.glob("recjax_criteo_spill_*"))
    with pytest.raises(ValueError, match="deleted by close"):
        next(prepared.blocks("train"))
    assert sum(b.size for b in prepared.blocks("validation")) == 5  # 71 lines: day 6 is lines 62-71

    strict = dataclasses.replace(options, strict=True)
    with pytest.raises(ValueError, match=r"train.txt: line 51: 2 tab-separated fields"):
        criteo.prepare_criteo(criteo.kaggle_splits(path), strict)
    assert not list(tmp_path.glob("recjax_criteo_spill_*"))


def test_fit_vocabulary_and_apply_on_chunks(tmp_path):
    data = skewed_text(500, seed=11)
    path = write(tmp_path, "train.txt", data)
    chunks = list(criteo.parse_file(path, chunk_bytes=SMALL_CHUNK * 4))
    assert len(chunks) > 3
    vocabulary = criteo.fit_vocabulary(chunks, criteo.CriteoOptions(frequency_threshold=2))
    expected = brute_force_vocabulary(reference_parse(data)[0], 2)
    batch = concatenate([criteo.apply(vocabulary, c) for c in chunks])
    for f, (index_of, _) in enumerate(expected):
        assert batch.ids[f"C{f + 1}"][:, 0].tolist() == [index_of.get(k, 0) for k in
                                                          np.concatenate([c.cats[:, f] for c in chunks]).tolist()]
    validate_batch(batch, vocabulary.spec())


def test_statistics_histogram_and_save(tmp_path):
    data = skewed_text(1400, seed=12)
    path = write(tmp_path, "train.txt", data)
    prepared = criteo.prepare_criteo(criteo.kaggle_splits(path), criteo.CriteoOptions(frequency_threshold=3))
    train_rows = [r for r in reference_parse(data)[0] if r[0] <= 1200]
    for f in (0, 7, 25):
        counts = collections.Counter(r[3][f] for r in train_rows)
        stats = prepared.stats.summary["features"][f"C{f + 1}"]
        buckets = collections.Counter(int(math.log2(c)) for c in counts.values())
        histogram = stats["frequency_histogram"]
        assert histogram["keys"] == [buckets.get(b, 0) for b in range(len(histogram["keys"]))]
        assert histogram["min_count"][:3] == [1, 2, 4]
        assert sum(histogram["occurrences"]) == stats["train_occurrences"] == len(train_rows)
        assert stats["raw_distinct_train"] == len(counts) and stats["missing_train"] == counts.get(MISSING, 0)
        assert stats["out_of_vocabulary_train"] == sum(c for c in counts.values() if c < 3)
        assert stats["vocab_size"] == 1 + sum(1 for c in counts.values() if c >= 3)
    prepared.stats.save(tmp_path / "stats")
    saved = json.loads((tmp_path / "stats" / "stats.json").read_text())
    assert saved["vocab_sizes"] == [f.vocab_size for f in prepared.spec.features]
    with np.load(tmp_path / "stats" / "index_counts.npz") as counts_file:
        assert counts_file["C8"].tolist() == prepared.stats.index_counts["C8"].tolist()


def test_options_are_validated():
    with pytest.raises(ValueError, match="needs 1 <= max_index"):
        criteo.CriteoOptions(vocab="hash")
    with pytest.raises(ValueError, match="'frequency' or 'hash'"):
        criteo.CriteoOptions(vocab="none")
    with pytest.raises(ValueError, match="frequency_threshold must be >= 1"):
        criteo.CriteoOptions(frequency_threshold=0)
