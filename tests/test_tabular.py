"""Generic tabular data (recjax/data/tabular.py) against independent oracles: Python's csv module and plain-Python
parses of the fixtures (tests/data/tabular, made by make_fixtures.py there), a pure-Python version of the key hash
and of the split draw, hand-computed vocabularies and numpy statistics."""

import csv
import gzip
import math
import pathlib
import re
import shutil
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recjax.data import make_dataset, tabular, tabular_formats
from recjax.data.arrays import concatenate
from recjax.data.textio import ParseReport, merge_report
from recjax.data.vocabulary import string_keys
from recjax.errors import ConfigError, DataError

FIXTURES = pathlib.Path(__file__).parent / "data" / "tabular"
CSV_BAD = {
    9: "25 fields, expected 26 (delimiter ','; a record cannot span lines)",
    13: "label column 'click' is empty",
    17: "column 'price' = 'abc' is not a number",
    21: "column 'price' = 'inf' is infinite",
    25: "unterminated quoted field (an odd number of '\"'); a record cannot span lines",
    30: "label column 'click' = 'nan' is NaN",
}
M64 = 2**64


# ----------------------------------------------------------------------------------------------------------------------
# Oracles
# ----------------------------------------------------------------------------------------------------------------------


def py_mix(x: int) -> int:
    """splitmix64's finaliser in plain Python integers."""
    x ^= x >> 30
    x = x * 0xBF58476D1CE4E5B9 % M64
    x ^= x >> 27
    x = x * 0x94D049BB133111EB % M64
    return x ^ (x >> 31)


def py_key(value: str | bytes) -> int:
    """The documented raw key of a value, one word at a time."""
    data = value.encode() if isinstance(value, str) else value
    h = py_mix((0x9E3779B97F4A7C15 + len(data)) % M64)
    for i in range(0, len(data), 8):
        h = py_mix(h ^ int.from_bytes(data[i:i + 8].ljust(8, b"\0"), "little"))
    return h & (2**63 - 1)


def py_uniform(seed: int, row: int) -> float:
    """The random split's draw for valid row `row` (0-based, in file order)."""
    x = py_mix(py_mix((seed + 0x9E3779B97F4A7C15) % M64) ^ row)
    return (x >> 11) * 2.0**-53


def reference_csv(path: pathlib.Path, *, label: str, dense: tuple[str, ...] = (), delimiter: str = ",",
                  names: tuple[str, ...] | None = None) -> tuple[dict[int, dict], list[int], list[int]]:
    """({line: {column: text}} of the good lines, bad lines, blank lines) by Python's csv module, line by line."""
    lines = path.read_text(encoding="utf-8").split("\n")
    if lines[-1] == "":
        lines.pop()
    first = 1
    if names is None:
        names, first = tuple(next(csv.reader([lines[0]], delimiter=delimiter))), 2
    good, bad, blank = {}, [], []
    for number, line in enumerate(lines[first - 1:], first):
        if not line.rstrip("\r"):
            blank.append(number)
            continue
        fields = next(csv.reader([line], delimiter=delimiter))
        row = dict(zip(names, fields, strict=False))
        ok = line.count('"') % 2 == 0 and len(fields) == len(names)
        if ok:
            try:
                ok = math.isfinite(float(row[label])) and all(row[c] == "" or math.isfinite(float(row[c]))
                                                              for c in dense)
            except ValueError:
                ok = False
        (good.__setitem__(number, row) if ok else bad.append(number))
    return good, bad, blank


def config(**fields) -> tabular.TabularOptions:
    """A data section from the defaults with dotted overrides, e.g. config(**{"sparse.columns": ("a",)})."""
    data = tabular.default_data_config()
    data.dir = str(FIXTURES)
    for key, value in fields.items():
        node = data
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        node[last] = value
    return data


def options(runtime: dict | None = None, **fields) -> tabular.TabularOptions:
    return tabular.TabularOptions.from_config(config(**fields), **(runtime or {}))


def parse(opts: tabular.TabularOptions, paths=None) -> tuple[list[tabular_formats.ParsedChunk], ParseReport]:
    """Every unit of the files parsed (the readers alone, no splits), and the merged report."""
    plan = opts.read_plan()
    paths = paths or tabular.source_paths(opts, opts.dir)
    report, chunks = ParseReport(), []
    for unit in tabular_formats.units(paths, plan):
        chunk, block = tabular_formats.parse_unit(unit, plan)
        merge_report(report, block, chunk.size, strict=opts.strict, expected="rows")
        chunks.append(chunk)
    return [c for c in chunks if c.size], report


def rows_of(chunks, feature):
    """Per row the raw keys of `feature` (a list per row for bags)."""
    out = []
    for chunk in chunks:
        values = chunk.sparse[feature]
        keys = values.keys[values.inverse]
        if values.lengths is None:
            out += keys.tolist()
        else:
            out += [list(k) for k in np.split(keys, np.cumsum(values.lengths)[:-1])] if values.lengths.size else []
    return out


def all_blocks(prepared, split):
    return concatenate(list(prepared.blocks(split)))


CLICKS = {"files": "clicks.csv", "label.column": "click", "dense.columns": ("price",),
          "sparse.columns": ("site_id", "app_id", "C14", "tags"), "sparse.multi_valued": ("tags",)}


# ----------------------------------------------------------------------------------------------------------------------
# Keys and the split draw
# ----------------------------------------------------------------------------------------------------------------------


def test_string_keys_equal_the_plain_python_hash():
    rng = np.random.default_rng(0)
    values = [b"", b"a", b"a\0", b"\0", b"12345678", b"123456789", b"x" * 16, b"x" * 17, "Zürich".encode(),
              bytes(range(256))] + [rng.bytes(int(n)) for n in rng.integers(0, 40, 300)]
    offsets = np.cumsum([0] + [len(v) for v in values])
    keys = string_keys(offsets, np.frombuffer(b"".join(values), np.uint8))
    assert keys.tolist() == [py_key(v) for v in values]
    assert len(set(keys[:3].tolist())) == 3  # "", "a", "a\0" differ: the length is mixed in
    assert py_key(b"") == tabular_formats.MISSING_STRING_KEY


def test_split_draw_equals_the_plain_python_draw():
    rows = np.array([0, 1, 2, 3, 1000, 2**39, 2**62], np.int64)
    for seed in (0, 7, 2**63 - 1):
        assert tabular.split_uniform(seed, rows).tolist() == [py_uniform(seed, int(r)) for r in rows]


# ----------------------------------------------------------------------------------------------------------------------
# CSV, TSV, gzip, Parquet
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_bytes,threads", [(1 << 20, 1), (700, 2)])
def test_csv_with_header_matches_the_csv_module(chunk_bytes, threads):
    opts = options({"chunk_bytes": chunk_bytes, "num_threads": threads}, **CLICKS, **{"dense.transform": "log1p"})
    chunks, report = parse(opts)
    good, bad, blank = reference_csv(FIXTURES / "clicks.csv", label="click", dense=("price",))
    assert sorted(CSV_BAD) == bad and blank == [6]
    assert [(line, reason) for _, line, reason in report.first_skipped] == sorted(CSV_BAD.items())
    assert (report.lines_read, report.rows_kept, report.blank_lines, report.skipped) == (41, 34, 1, 6)
    assert np.concatenate([c.positions for c in chunks]).tolist() == sorted(good)
    rows = [good[n] for n in sorted(good)]
    assert np.concatenate([c.labels for c in chunks]).tolist() == [float(float(r["click"]) >= 0.5) for r in rows]
    expected_dense = [math.log1p(float(r["price"]) if r["price"] else 0.0) for r in rows]
    np.testing.assert_allclose(np.concatenate([c.dense for c in chunks])[:, 0], expected_dense, rtol=1e-6)
    for column in ("site_id", "app_id", "C14"):  # app_id has empty cells: the key of "" (missing), not an error
        assert rows_of(chunks, column) == [py_key(r[column]) for r in rows]
    assert rows_of(chunks, "tags") == [[py_key(t) for t in r["tags"].split("|") if t] for r in rows]
    assert any(r["site_domain"] == "28f0,0481" for r in rows)  # line 28's quoted delimiter is one field


def test_a_bad_cell_does_not_change_how_the_other_cells_of_its_block_convert(tmp_path):
    # pyarrow's fast float conversion fails a whole block on one bad cell; the block is then read as text and
    # converted cell by cell. Both paths must agree on every cell (value, missing, or bad).
    cells = ["1", "-2.5", " 5", "5 ", "\t7", "+5", ".5", "5.", "1e3", "NA", "N/A", "nan", "NaN", "-nan", "NAN", "null",
             "", "inf", "-Infinity", "1e400", "0x10", "1,5", "five", "  "]
    fields = {"dir": str(tmp_path), "label.column": "y", "dense.columns": ("x",), "sparse.columns": ("s",)}
    for cell in cells:
        quoted = f'"{cell}"' if "," in cell else cell
        (tmp_path / "fast.csv").write_text(f"y,x,s\n1,{quoted},a\n")
        (tmp_path / "slow.csv").write_text(f"y,x,s\n1,{quoted},a\n1,abc,a\n")
        fast, fast_report = parse(options(**fields, files="fast.csv"))
        slow, slow_report = parse(options(**fields, files="slow.csv"))
        # (the fast path shows the parsed number, the other the cell's text)
        assert [re.sub("'.*'", "V", r) for _, n, r in fast_report.first_skipped] == [
            re.sub("'.*'", "V", r) for _, n, r in slow_report.first_skipped if n == 2], cell
        assert [c.dense.tolist() for c in fast] == [c.dense.tolist() for c in slow], cell
        assert [(c.dense_missing.tolist(), c.dense_nan.tolist()) for c in fast] == [
            (c.dense_missing.tolist(), c.dense_nan.tolist()) for c in slow], cell


# pyarrow's handler glue prints its own UnicodeDecodeError as "Exception ignored" before failing the parse.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_quotes_and_invalid_utf8_in_short_or_long_rows(tmp_path):
    # pyarrow hands a row with the wrong field count to its handler with the row's text, which it cannot decode when
    # the row is not UTF-8; both kinds are bad lines with their own reason, and the lines around them are kept.
    (tmp_path / "q.csv").write_bytes(b'a,b,c\n1,"x,""y",2\n1,"q",\n1,"x""y",3,4\n1,\xff,3,4\n1,z,3\n')
    chunks, report = parse(options(dir=str(tmp_path), files="q.csv", **{"label.column": "a", "sparse.columns": ("b",),
                                                                         "dense.columns": ("c",)}))
    assert np.concatenate([c.positions for c in chunks]).tolist() == [2, 3, 6]
    assert rows_of(chunks, "b") == [py_key('x,"y'), py_key("q"), py_key("z")]
    assert [(n, r) for _, n, r in report.first_skipped] == [
        (4, "4 fields, expected 3 (delimiter ','; a record cannot span lines)"),
        (5, "wrong field count, expected 3 (delimiter ','), and not valid UTF-8")]


def test_strict_mode_names_file_line_reason_and_what_to_do():
    with pytest.raises(DataError, match=r"clicks\.csv: line 9: 25 fields, expected 26 .*; fix or remove the line, "
                                        r"or set data\.strict=False to skip and report bad lines"):
        tabular.prepare_tabular(options(**CLICKS, strict=True))


TSV = {"files": "clicks_noheader.tsv", "csv.delimiter": "\t", "csv.header": False, "label.column": "0",
       "dense.columns": ("1",), "sparse.columns": ("2", "3", "4"), "sparse.multi_valued": ("4",),
       "sparse.separator": ",", "split.validation_fraction": 0.3, "split.test_fraction": 0.3}


def test_tsv_without_header_by_position_gzip_crlf_and_names(tmp_path):
    names = ("0", "1", "2", "3", "4")
    good, bad, blank = reference_csv(FIXTURES / "clicks_noheader.tsv", label="0", dense=("1",), delimiter="\t",
                                     names=names)
    chunks, report = parse(options(**TSV))
    assert [line for _, line, _ in report.first_skipped] == bad == [4, 10, 20] and blank == [15]
    assert [r for _, _, r in report.first_skipped][:2] == [
        "6 fields, expected 5 (delimiter '\\t'; a record cannot span lines)", "column '1' = '12x' is not a number"]
    rows = [good[n] for n in sorted(good)]
    assert np.concatenate([c.dense for c in chunks])[:, 0].tolist() == [float(r["1"] or 0) for r in rows]
    assert rows_of(chunks, "3") == [py_key(r["3"]) for r in rows]  # UTF-8 "Zürich", "Köln"
    assert rows_of(chunks, "4") == [[py_key(t) for t in r["4"].split(",") if t] for r in rows]

    # The same file gzipped, with CRLF line ends, or with named columns: the same prepared blocks.
    text = (FIXTURES / "clicks_noheader.tsv").read_bytes()
    (tmp_path / "clicks.tsv.gz").write_bytes(gzip.compress(text))
    (tmp_path / "clicks_crlf.tsv").write_bytes(text.replace(b"\n", b"\r\n"))
    reference = tabular.tabular_array_dataset(options(**TSV))
    for variant in (options(**{**TSV, "dir": str(tmp_path), "files": "clicks.tsv.gz"}),
                    options(**{**TSV, "dir": str(tmp_path), "files": "clicks_crlf.tsv"}),
                    options(**{**TSV, "csv.column_names": ("label", "visits", "category", "city", "tags"),
                               "label.column": "label", "dense.columns": ("visits",),
                               "sparse.columns": ("category", "city", "tags"), "sparse.multi_valued": ("tags",)})):
        dataset = tabular.tabular_array_dataset(variant)
        for split in tabular.SPLITS:
            a, b = reference.splits[split], dataset.splits[split]
            np.testing.assert_array_equal(a.labels, b.labels)
            np.testing.assert_array_equal(a.dense, b.dense)
            assert [a.ids[f].tolist() for f in ("2", "3", "4")] == [b.ids[f].tolist() for f in b.ids]
    with pytest.raises(DataError, match=r"data\.csv\.column_names has 4 names but line 1 of .*has 5 fields"):
        tabular.prepare_tabular(options(**{**TSV, "csv.column_names": ("a", "b", "c", "d"), "label.column": "a",
                                           "dense.columns": (), "sparse.columns": ("c",), "sparse.multi_valued": ()}))


def test_lines_ending_in_several_carriage_returns_read_like_plain_lines(tmp_path):
    # "\r\r\n" is what converting a CRLF file to CRLF again gives: every '\r' before the '\n' is the line end.
    text = (FIXTURES / "clicks_noheader.tsv").read_bytes()
    lines = text.split(b"\n")[:-1]
    ends = [b"\r\r\n", b"\r\n", b"\n", b"\r\r\r\n"]
    (tmp_path / "crcr.tsv").write_bytes(b"".join(line + ends[i % 4] for i, line in enumerate(lines)))
    reference = tabular.tabular_array_dataset(options(**TSV))
    for chunk_bytes in (1 << 20, 90):
        variant = options({"chunk_bytes": chunk_bytes}, **{**TSV, "dir": str(tmp_path), "files": "crcr.tsv"})
        with tabular.prepare_tabular(variant) as prepared:
            assert [(n, r) for _, n, r in prepared.report.first_skipped] == [
                (4, "6 fields, expected 5 (delimiter '\\t'; a record cannot span lines)"),
                (10, "column '1' = '12x' is not a number"), (20, "label column '0' is empty")]
            for split in tabular.SPLITS:
                a, b = reference.splits[split], all_blocks(prepared, split)
                np.testing.assert_array_equal(a.labels, b.labels)
                np.testing.assert_array_equal(a.dense, b.dense)
                assert [a.ids[f].tolist() for f in a.ids] == [b.ids[f].tolist() for f in b.ids]

    libfm = (FIXTURES / "frappe.train.libfm").read_bytes()
    (tmp_path / "crcr.libfm").write_bytes(libfm.replace(b"\n", b"\r\r\n"))
    plain, plain_report = parse(options(format="libsvm", files="frappe.train.libfm"))
    crcr, crcr_report = parse(options(dir=str(tmp_path), format="libsvm", files="crcr.libfm"))
    assert crcr_report.first_skipped == [(str(tmp_path / "crcr.libfm"), n, r) for _, n, r in plain_report.first_skipped]
    assert [rows_of(crcr, f"f{k}") for k in range(10)] == [rows_of(plain, f"f{k}") for k in range(10)]

    # A '\r' inside a line is still a bad line; a block (or file) of nothing but bad lines says why, line by line.
    (tmp_path / "stray.csv").write_bytes(b"y,s\r\n1,a\rb\r\r\n0,c\r\n")
    chunks, report = parse(options(dir=str(tmp_path), files="stray.csv", **{"label.column": "y",
                                                                            "sparse.columns": ("s",)}))
    assert [(n, r) for _, n, r in report.first_skipped] == [(2, "stray carriage return (\\r) inside the line")]
    assert rows_of(chunks, "s") == [py_key("c")]
    (tmp_path / "quotes.csv").write_text('y,s\n1,"a\n0,"b\n')
    with pytest.raises(DataError, match=r"no valid rows in quotes\.csv \(2 lines: 0 rows kept, 2 bad lines skipped.*"
                                        r"quotes\.csv:2: unterminated quoted field"):
        tabular.prepare_tabular(options(dir=str(tmp_path), files="quotes.csv", **{"label.column": "y",
                                                                                  "sparse.columns": ("s",)}))


def test_a_truncated_gzip_file_is_named_with_its_last_complete_line(tmp_path):
    rng = np.random.default_rng(1)
    text = "y,x,s\n" + "".join(f"{rng.integers(2)},{rng.integers(100)},{rng.choice(list('abc'))}\n"
                               for _ in range(3000))
    compressed = gzip.compress(text.encode())
    path = tmp_path / "cut.csv.gz"
    path.write_bytes(compressed[:len(compressed) * 2 // 3])
    decoder = zlib.decompressobj(wbits=31)
    prefix = decoder.decompress(path.read_bytes())  # what can be decoded before the cut (the oracle)
    assert not decoder.eof and not prefix.endswith(b"\n")
    last_complete = prefix.count(b"\n")  # the header is line 1
    fields = {"dir": str(tmp_path), "files": "cut.csv.gz", "label.column": "y", "dense.columns": ("x",),
              "sparse.columns": ("s",)}
    with tabular.prepare_tabular(options(**fields)) as prepared:
        report = prepared.report
        assert report.rows_kept == last_complete - 1 and report.skipped == 1
        cut = "gzip stream ends before its end-of-stream marker (file cut short?)"
        assert report.first_skipped == [(str(path), last_complete + 1, f"incomplete last line: {cut}")]
        assert report.truncated_files == [(str(path), "gzip stream ends before its end-of-stream marker (file cut "
                                                      f"short?); the last complete line is {last_complete}")]
    with pytest.raises(DataError, match=rf"cut\.csv\.gz: gzip stream ends before its end-of-stream marker \(file cut "
                                        rf"short\?\) \(in line {last_complete + 1}\): the file is truncated after line "
                                        rf"{last_complete}; re-download or re-compress the file"):
        tabular.prepare_tabular(options(**fields, strict=True))


def _clean_table(path: pathlib.Path):
    good, _, _ = reference_csv(path, label="click", dense=("price",))
    rows = [good[n] for n in sorted(good)]
    return pa.table({
        "click": pa.array([int(r["click"]) for r in rows], pa.int64()),
        "hour": pa.array([int(r["hour"]) for r in rows], pa.int64()),
        "C1": pa.array([int(r["C1"]) for r in rows], pa.int32()),
        "site_id": pa.array([r["site_id"] for r in rows], pa.string()),
        "app_id": pa.array([r["app_id"] or None for r in rows], pa.string()),  # null, where the CSV has ""
        "price": pa.array([float(r["price"]) if r["price"] else None for r in rows], pa.float64()),
        "tags": pa.array([r["tags"] for r in rows], pa.string()),
    })


def test_parquet_gives_the_same_blocks_as_csv(tmp_path):
    table = _clean_table(FIXTURES / "clicks.csv")
    pq.write_table(table, tmp_path / "clicks.parquet", row_group_size=7)
    with open(tmp_path / "clicks.csv", "w", newline="") as f:  # the same rows as text
        writer = csv.writer(f)
        writer.writerow(table.column_names)
        for row in table.to_pylist():
            writer.writerow(["" if v is None else repr(v) if isinstance(v, float) else v for v in row.values()])
    fields = {"dir": str(tmp_path), "label.column": "click", "dense.columns": ("price",),
              "dense.transform": "log1p+standardise", "sparse.columns": ("site_id", "app_id", "C1", "tags"),
              "sparse.multi_valued": ("tags",), "split.method": "time", "split.time_column": "hour"}
    from_csv = tabular.tabular_array_dataset(options(**fields, files="clicks.csv"))
    from_parquet = tabular.tabular_array_dataset(options(**fields, files="clicks.parquet", format="parquet"))
    assert from_csv.spec == from_parquet.spec
    for split in tabular.SPLITS:
        a, b = from_csv.splits[split], from_parquet.splits[split]
        for name in ("dense", "labels"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        for feature in a.ids:
            np.testing.assert_array_equal(a.ids[feature], b.ids[feature])
            np.testing.assert_array_equal(a.lengths[feature], b.lengths[feature])
    assert from_csv.info()["tabular_stats"]["features"] == from_parquet.info()["tabular_stats"]["features"]

    # Text cells in a Parquet column are converted like CSV cells; a bad one is reported by its 1-based row.
    prices = pa.array(["1.5", "", "abc", "2", "3"], pa.string())
    small = pa.table({"click": [1, 0, 1, 0, 1], "t": [1, 2, 3, 4, 5], "site_id": ["a", "b", "a", "b", "a"],
                      "price": prices})
    pq.write_table(small, tmp_path / "text.parquet")
    fields = {"dir": str(tmp_path), "files": "text.parquet", "format": "parquet", "label.column": "click",
              "dense.columns": ("price",), "sparse.columns": ("site_id",), "split.method": "time",
              "split.time_column": "t", "split.validation_fraction": 0.34, "split.test_fraction": 0.34}
    with tabular.prepare_tabular(options(**fields)) as prepared:
        assert [(line, reason) for _, line, reason in prepared.report.first_skipped] == [
            (3, "column 'price' = 'abc' is not a number")]
    with pytest.raises(DataError, match=r"text\.parquet: row 3: column 'price' = 'abc' is not a number"):
        tabular.prepare_tabular(options(**fields, strict=True))


# ----------------------------------------------------------------------------------------------------------------------
# Labels, dense transforms, vocabularies, bags
# ----------------------------------------------------------------------------------------------------------------------


def write_splits(directory: pathlib.Path, header: str, **splits: list[str]) -> dict:
    """train.csv / validation.csv / test.csv with the given lines; the fields of a "files" split over them."""
    for split, lines in splits.items():
        (directory / f"{split}.csv").write_text("\n".join([header] + lines) + "\n")
    return {"dir": str(directory), "split.method": "files", "split.train_files": "train.csv",
            "split.validation_files": "validation.csv", "split.test_files": "test.csv"}


def test_label_binarisation_by_threshold_and_by_value_set(tmp_path):
    files = write_splits(tmp_path, "rating,answer,item", train=["1,no,a", "4,yes,b", "5,yes,a", "3.5,No,a"],
                         validation=["-1,yes,a", "4.0,,b"], test=["2,no,a"])
    common = {**files, "sparse.columns": ("item",)}
    by_rating = tabular.tabular_array_dataset(options(**common, **{"label.column": "rating", "label.threshold": 4}))
    assert by_rating.splits["train"].labels.tolist() == [0, 1, 1, 0]
    assert by_rating.splits["validation"].labels.tolist() == [0, 1]
    by_answer = options(**common, **{"label.column": "answer", "label.positive_values": ("yes",)})
    with tabular.prepare_tabular(by_answer) as prepared:
        assert all_blocks(prepared, "train").labels.tolist() == [0, 1, 1, 0]  # "No" is not "yes"
        assert [(n, r) for _, n, r in prepared.report.first_skipped] == [(3, "label column 'answer' is empty")]


def test_label_values_are_checked_when_preparing(tmp_path):
    # Text among numeric labels is a setting to fix, not a bad line: preparing stops once the files are read, naming
    # every value, in lenient and strict mode, whatever the format.
    rows = ["1", "no", "1", "no", "no", "0", "yes", "2"] * 5
    (tmp_path / "mixed.csv").write_text("y,s\n" + "".join(f"{v},{'ab'[i % 2]}\n" for i, v in enumerate(rows)))
    pq.write_table(pa.table({"y": rows, "s": ["a"] * len(rows)}), tmp_path / "mixed.parquet")
    (tmp_path / "mixed.libsvm").write_text("".join(f"{v} 3:1\n" for v in rows))
    fields = {"dir": str(tmp_path), "label.column": "y", "sparse.columns": ("s",)}
    numbers = "the numbers: '1' x10, '0' x5, '2' x5. data.label.threshold (0.5) needs numbers: set " \
              "data.label.positive_values to the values that mean a click (every other value is 0)"
    for extra, name, where in (({"files": "mixed.csv"}, "label column 'y'", "mixed.csv, line 3"),
                               ({"files": "mixed.csv", "strict": True}, "label column 'y'", "mixed.csv, line 3"),
                               ({"files": "mixed.parquet", "format": "parquet"}, "label column 'y'",
                                "mixed.parquet, row 2"),
                               ({"files": "mixed.libsvm", "format": "libsvm", "label.column": "label",
                                 "sparse.columns": ()}, "the label (each line's first token)", "mixed.libsvm, line 2")):
        with pytest.raises(DataError, match=re.escape(f"data.label: {name} holds values that are not numbers: 'no' "
                                                      f"x15, 'yes' x5 (the first in {where}); {numbers}")):
            tabular.prepare_tabular(options(**{**fields, **extra}))

    # With positive_values every text is a value: "yes", "1" and "2" are clicks; the console shows the values.
    clicks = options(**fields, files="mixed.csv", **{"label.positive_values": ("yes", "1", "2")})
    with tabular.prepare_tabular(clicks) as prepared:
        labels = np.concatenate([all_blocks(prepared, split).labels for split in tabular.SPLITS])
        assert sorted(labels.tolist()) == sorted(float(v in ("yes", "1", "2")) for v in rows)
        stats = prepared.stats.summary
        train, positives = stats["split_rows"]["train"], stats["train_positives"]
        assert [line for line in tabular.summary_lines(stats) if line.startswith("data: label")] == [
            f"data: label = label column 'y' in data.label.positive_values ['yes', '1', '2']: {positives} of {train} "
            f"train rows positive ({positives / train:.1%}); values: 'no' x15, '1' x10, '0' x5, 'yes' x5, '2' x5"]

    # One class in train: an error naming the counts and the values, not a run whose AUC is NaN.
    for values, positive in ((["0"] * 40, False), (["1", "2"] * 20, True)):
        (tmp_path / "one.csv").write_text("y,s\n" + "".join(f"{v},a\n" for v in values))
        shown = ", ".join(f"'{v}' x{values.count(v)}" for v in dict.fromkeys(values))
        one_class = (r"data\.label: the train split has one class: (\d+) of (\d+) train rows are positive \(label = "
                     rf"label column 'y' >= data\.label\.threshold = 0\.5; the label's values: {shown}\); a model "
                     "cannot learn")
        with pytest.raises(DataError, match=one_class) as error:
            tabular.prepare_tabular(options(**fields, files="one.csv"))
        found, rows_in_train = re.search(r"(\d+) of (\d+) train", str(error.value)).groups()
        assert int(found) == (int(rows_in_train) if positive else 0)


def test_dense_transforms_use_train_statistics_only(tmp_path):
    files = write_splits(tmp_path, "y,a,b,s", train=["1,0,1,x", "0,3,-2,x", "1,,5,y", "0,500,2,y"],
                         validation=["1,7,0,x", "0,-4,1,y"], test=["0,1,1,x"])
    fields = {**files, "label.column": "y", "dense.columns": ("a", "b"), "sparse.columns": ("s",),
              "dense.transform": "clip+log1p+standardise", "dense.clip_min": 0.0, "dense.clip_max": 100.0,
              "dense.transforms": {"b": "standardise"}, "dense.missing": 1.0}
    dataset = tabular.tabular_array_dataset(options(**fields))
    a_train = np.log1p(np.clip([0, 3, 1, 500], 0, 100))  # the empty cell is dense.missing = 1 before the chain
    b_train = np.array([1.0, -2, 5, 2])
    for split, a_raw, b_raw in (("train", [0, 3, 1, 500], b_train), ("validation", [7, -4], [0, 1])):
        a = np.log1p(np.clip(a_raw, 0, 100))
        np.testing.assert_allclose(dataset.splits[split].dense[:, 0], (a - a_train.mean()) / a_train.std(), rtol=1e-6)
        np.testing.assert_allclose(dataset.splits[split].dense[:, 1], (np.array(b_raw) - b_train.mean())
                                   / b_train.std(), rtol=1e-6)
    stats = dataset.info()["tabular_stats"]["dense"]
    assert stats["a"]["transform"] == "clip+log1p+standardise" and stats["b"]["transform"] == "standardise"
    np.testing.assert_allclose([stats["a"]["mean"], stats["a"]["std"]], [a_train.mean(), a_train.std()])

    # log1p without a clip: a value <= -1 has no finite log and is a bad line saying what to do.
    fields.update({"dense.transform": "log1p", "dense.transforms": {}})
    with tabular.prepare_tabular(options(**fields)) as prepared:
        assert [(pathlib.Path(f).name, n, r) for f, n, r in prepared.report.first_skipped] == [
            ("train.csv", 3, "column 'b' = '-2.0': log1p needs values > -1 (after clip; the missing value is 1.0); "
                             "set data.dense.clip_min or drop log1p for this column"),
            ("validation.csv", 3, "column 'a' = '-4.0': log1p needs values > -1 (after clip; the missing value is "
                                  "1.0); set data.dense.clip_min or drop log1p for this column")]


def dense_cell_kind(cell: str) -> str:
    """The documented class of a dense cell: "missing" (empty, NA, NULL, ...), "nan" (a spelling of NaN), "number"
    or "bad" (not a number, or infinite)."""
    if cell in ("", "NA", "NULL", "N/A", "null"):
        return "missing"
    text = cell.strip(" \t")
    if text.lower().lstrip("+-") in ("nan", "1.#qnan", "1.#ind"):
        return "nan"
    try:
        return "number" if math.isfinite(float(text)) else "bad"
    except ValueError:
        return "bad"


def test_nan_dense_cells_are_imputed_and_counted_or_skipped(tmp_path):
    cells = ["nan", "NaN", "-nan", "NAN", " nan", "+nan", "1.#QNAN", "-1.#IND", "NA", "", "NULL", "1.5", "abc", "inf",
             "3"] * 5
    (tmp_path / "d.csv").write_text("y,x,s\n" + "".join(f"{i % 2},{c},{'ab'[i % 3 % 2]}\n"
                                                          for i, c in enumerate(cells)))
    kinds = [dense_cell_kind(c) for c in cells]
    fields = {"dir": str(tmp_path), "files": "d.csv", "label.column": "y", "dense.columns": ("x",),
              "sparse.columns": ("s",), "dense.missing": -7.0}
    for chunk_bytes in (1 << 20, 16):  # one block (read as text: 'abc' fails pyarrow's converter), or ~a line each
        runtime = {"chunk_bytes": chunk_bytes}
        chunks, report = parse(options(runtime, **fields))
        kept = [k for k in kinds if k != "bad"]
        assert np.concatenate([c.dense[:, 0] for c in chunks]).tolist() == [
            float(c) if k == "number" else -7.0 for c, k in zip(cells, kinds, strict=True) if k != "bad"]
        assert sum(int(c.dense_nan[0]) for c in chunks) == kept.count("nan") == 40
        assert sum(int(c.dense_missing[0]) for c in chunks) == kept.count("missing") == 15
        assert report.skipped == kinds.count("bad") == 10

        chunks, report = parse(options(runtime, **fields, **{"dense.nan": "skip"}))
        assert np.concatenate([c.positions for c in chunks]).tolist() == [
            n for n, k in enumerate(kinds, 2) if k in ("number", "missing")]
        assert sum(int(c.dense_nan[0]) for c in chunks) == 0
        assert report.skipped == kinds.count("bad") + kinds.count("nan")
        assert report.first_skipped[0] == (str(tmp_path / "d.csv"), 2, (
            "column 'x' = 'nan' is NaN (data.dense.nan='skip'; 'impute' replaces NaN by data.dense.missing = -7 and "
            "counts it)"))
        assert [n for _, n, r in report.first_skipped if " is NaN " in r] == [2, 3, 4, 5, 6, 7, 8, 9]

    # Parquet: a float NaN is NaN, a null is missing; libSVM: a dense index's NaN value likewise, an absent one missing.
    pq.write_table(pa.table({"y": [1, 0, 1, 0], "x": [float("nan"), None, 1.5, float("nan")], "s": list("abab")}),
                   tmp_path / "d.parquet")
    chunks, _ = parse(options(**{**fields, "files": "d.parquet", "format": "parquet"}))
    assert chunks[0].dense[:, 0].tolist() == [-7.0, -7.0, 1.5, -7.0]
    assert (chunks[0].dense_nan.tolist(), chunks[0].dense_missing.tolist()) == ([2], [1])
    (tmp_path / "d.libsvm").write_text("1 3:1 7:nan\n0 3:1 7:0.5\n1 3:1\n0 3:1 7:NaN\n")
    libsvm = {"dir": str(tmp_path), "files": "d.libsvm", "format": "libsvm", "libsvm.fields": "bag",
              "libsvm.dense_indices": (7,), "dense.missing": -7.0}
    chunks, _ = parse(options(**libsvm))
    assert chunks[0].dense[:, 0].tolist() == [-7.0, 0.5, -7.0, -7.0]
    assert (chunks[0].dense_nan.tolist(), chunks[0].dense_missing.tolist()) == ([2], [1])
    chunks, report = parse(options(**libsvm, **{"dense.nan": "skip"}))
    assert chunks[0].positions.tolist() == [2, 3] and [n for _, n, _ in report.first_skipped] == [1, 4]
    assert report.first_skipped[0][2].startswith("token '7:nan': dense index 7 is NaN (data.dense.nan='skip'")

    # Prepared: the counts of every split are in the stats and on the console.
    with tabular.prepare_tabular(options(**fields)) as prepared:
        stats = prepared.stats.summary
        assert (stats["dense"]["x"]["nan_imputed"], stats["dense"]["x"]["missing_imputed"]) == (40, 15)
        assert [line for line in tabular.summary_lines(stats) if "dense cells" in line] == [
            "data: dense cells set to data.dense.missing = -7: x 15 empty / null + 40 NaN (data.dense.nan = 'impute'; "
            "'skip' makes a line with a NaN a bad line)"]


def test_dense_columns_are_standardised_by_default_as_the_readme_says(tmp_path):
    files = write_splits(tmp_path, "y,a,b,s", train=["1,1,-3,x", "0,2,5,x", "1,3,,y", "0,10,7,y"],
                         validation=["1,4,0,x", "0,-6,1,y"], test=["0,1,1,x"])
    fields = {**files, "label.column": "y", "dense.columns": ("a", "b"), "sparse.columns": ("s",)}
    dataset = tabular.tabular_array_dataset(options(**fields))
    train = np.array([[1, -3], [2, 5], [3, 0], [10, 7]], float)  # the empty cell is data.dense.missing = 0
    mean, std = train.mean(axis=0), train.std(axis=0)
    np.testing.assert_allclose(dataset.splits["train"].dense, (train - mean) / std, rtol=1e-6)
    np.testing.assert_allclose(dataset.splits["validation"].dense, (np.array([[4, 0], [-6, 1]]) - mean) / std,
                               rtol=1e-6)
    assert tabular.summary_lines(dataset.info()["tabular_stats"])[0] == (
        "data: dense transform (data.dense.transform, per column data.dense.transforms): standardise for a, b")
    # README states the default the code has.
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    stated = re.search(r"`data\.dense\.transform` \(default `([^`]+)`", readme)
    assert stated and stated.group(1) == tabular.default_data_config().dense.transform == "standardise"
    fields.update({"dense.transform": "none", "dense.transforms": {"b": "clip+log1p+standardise"},
                   "dense.clip_min": 0.0})
    assert tabular.summary_lines(tabular.tabular_array_dataset(options(**fields)).info()["tabular_stats"])[0] == (
        "data: dense transform (data.dense.transform, per column data.dense.transforms): none for a; "
        "clip+log1p+standardise for b")


def test_frequency_vocabulary_by_hand_with_missing_and_unseen_values(tmp_path):
    train = ["1,a,a", "0,a,b", "1,a,c", "0,b,d", "1,b,a", "0,c,b", "1,c,c", "0,d,d", "1,,a", "0,,b"]
    files = write_splits(tmp_path, "y,site,app", train=train, validation=["1,a,a", "0,e,b", "1,,c", "0,d,x"],
                         test=["1,b,a"])
    fields = {**files, "label.column": "y", "sparse.columns": ("site", "app"), "sparse.frequency_threshold": 2,
              "sparse.overrides": {"app": {"vocab": "hash", "hash_buckets": 7}}}
    dataset = tabular.tabular_array_dataset(options(**fields))
    # site in train: a x3, b x2, c x2, "" x2 (missing: a category), d x1 (rare -> 0). Ids: a = 1, then the count-2
    # values by ascending raw key.
    tied = sorted(["b", "c", ""], key=py_key)
    ids = {"a": 1, **{v: i for i, v in enumerate(tied, 2)}, "d": 0, "e": 0}
    assert dataset.splits["train"].ids["site"][:, 0].tolist() == [ids[r.split(",")[1]] for r in train]
    assert dataset.splits["validation"].ids["site"][:, 0].tolist() == [ids[v] for v in ("a", "e", "", "d")]
    assert dataset.spec.features[0].vocab_size == 5
    stats = dataset.info()["tabular_stats"]["features"]["site"]
    assert (stats["raw_distinct_train"], stats["out_of_vocabulary_train"], stats["missing_train"],
            stats["train_occurrences"]) == (5, 1, 2, 10)
    assert dataset.splits["validation"].ids["app"][:, 0].tolist() == [py_key(v) % 7 for v in ("a", "b", "c", "x")]
    assert dataset.spec.features[1].vocab_size == 7
    with tabular.prepare_tabular(options(**fields)) as prepared:
        counts = prepared.stats.index_counts["site"]
        assert counts[0] == 1 and counts[1] == 3 and counts[2:].tolist() == [2, 2, 2]


def test_multi_valued_bags_empty_cells_and_truncation(tmp_path):
    files = write_splits(tmp_path, "y,tags", train=["1,x|y", "0,", "1,y", "0,x|y|z|w", "1,x||y"],
                         validation=["1,x|y|z|w|v", "0,q"], test=["1,z"])
    fields = {**files, "label.column": "y", "sparse.columns": ("tags",), "sparse.multi_valued": ("tags",)}
    dataset = tabular.tabular_array_dataset(options(**fields))
    train = dataset.splits["train"]
    assert dataset.spec.features[0].bag_size == 5  # the largest bag in any split
    assert train.lengths["tags"].tolist() == [2, 0, 1, 4, 2]  # "" is an empty bag; empty items are dropped
    # In train y is seen 4 times, x 3 times, z and w once (a tie: ascending key).
    ids = {"y": 1, "x": 2} | dict(zip(sorted("zw", key=py_key), (3, 4), strict=True))
    assert train.ids["tags"][0].tolist() == [ids["x"], ids["y"], 0, 0, 0]
    assert train.ids["tags"][1].tolist() == [0] * 5
    assert dataset.splits["validation"].ids["tags"][1].tolist() == [0] * 5  # q: unseen in train -> 0

    truncated = tabular.tabular_array_dataset(options(**fields, **{"sparse.max_bag_size": 2}))
    assert truncated.spec.features[0].bag_size == 2
    assert truncated.splits["train"].lengths["tags"].tolist() == [2, 0, 1, 2, 2]
    assert truncated.splits["train"].ids["tags"][3].tolist() == [ids["x"], ids["y"]]  # the first two values
    assert truncated.info()["tabular_stats"]["features"]["tags"]["truncated_bags"] == 2  # one in train, one in val


# ----------------------------------------------------------------------------------------------------------------------
# Splits
# ----------------------------------------------------------------------------------------------------------------------


def test_random_split_follows_the_per_row_draw_and_is_deterministic():
    fields = {**CLICKS, "split.seed": 3, "split.validation_fraction": 0.2, "split.test_fraction": 0.2}
    good, _, _ = reference_csv(FIXTURES / "clicks.csv", label="click", dense=("price",))
    expected = {split: [] for split in tabular.SPLITS}
    for row, line in enumerate(sorted(good)):
        u = py_uniform(3, row)
        split = "train" if u < 0.6 else "validation" if u < 0.8 else "test"
        expected[split].append(float(float(good[line]["click"]) >= 0.5))
    runs = [tabular.tabular_array_dataset(options({"chunk_bytes": chunk, "num_threads": threads}, **fields))
            for chunk, threads in ((1 << 20, 2), (600, 1), (900, 2))]
    for split in tabular.SPLITS:
        assert runs[0].splits[split].labels.tolist() == expected[split]
        for other in runs[1:]:  # bit-identical whatever the chunking and threads
            a, b = runs[0].splits[split], other.splits[split]
            assert a.dense.tobytes() == b.dense.tobytes() and a.labels.tobytes() == b.labels.tobytes()
            assert all(a.ids[f].tobytes() == b.ids[f].tobytes() for f in a.ids)
    assert sum(len(v) for v in expected.values()) == 34  # every valid row in exactly one split


def test_random_split_is_the_same_from_csv_parquet_and_libsvm(tmp_path):
    # The same rows as two CSV files (a header each, a blank and a bad line), one Parquet file (row groups of 7) and a
    # libSVM file: each split must hold the same rows -- told apart by a dense row number r -- as the oracle's draw
    # for the k-th valid row says.
    rng = np.random.default_rng(3)
    n = 60
    labels, sites = rng.integers(0, 2, n), rng.choice(["a", "b", "c"], n)
    csv_lines = [f"{y},{r},{s}" for r, (y, s) in enumerate(zip(labels, sites, strict=True))]
    (tmp_path / "part1.csv").write_text("y,r,s\n" + "\n".join(csv_lines[:25]) + "\n\n1,x,2,3\n")
    (tmp_path / "part2.csv").write_text("y,r,s\n" + "\n".join(csv_lines[25:]) + "\n")
    pq.write_table(pa.table({"y": labels, "r": np.arange(n), "s": sites}), tmp_path / "all.parquet", row_group_size=7)
    (tmp_path / "all.libsvm").write_text("".join(f"{y} 0:{r} {10 + 'abc'.index(s)}:1\n"
                                                 for r, (y, s) in enumerate(zip(labels, sites, strict=True))))
    common = {"dir": str(tmp_path), "split.seed": 11, "split.validation_fraction": 0.25, "split.test_fraction": 0.25}
    common = {**common, "dense.transform": "none"}
    columns = {"label.column": "y", "dense.columns": ("r",), "sparse.columns": ("s",)}
    variants = [options(**common, **columns, files="part*.csv"),
                options(**common, **columns, files="all.parquet", format="parquet"),
                options(**common, files="all.libsvm", format="libsvm", **{"libsvm.fields": "bag",
                                                                          "libsvm.dense_indices": (0,)})]
    expected = {split: [] for split in tabular.SPLITS}
    for r in range(n):
        u = py_uniform(11, r)
        expected["train" if u < 0.5 else "validation" if u < 0.75 else "test"].append(float(r))
    for variant in variants:
        dataset = tabular.tabular_array_dataset(variant)
        for split in tabular.SPLITS:
            assert dataset.splits[split].dense[:, 0].tolist() == expected[split], (variant.format, split)
            np.testing.assert_array_equal(dataset.splits[split].labels, labels[np.array(expected[split], int)])


def test_time_split_takes_the_latest_rows(tmp_path):
    # hour doubles as a dense column, so the blocks show which times each split got.
    fields = {**CLICKS, "dense.columns": ("price", "hour"), "split.method": "time", "split.time_column": "hour",
              "dense.transform": "none"}
    good, _, _ = reference_csv(FIXTURES / "clicks.csv", label="click", dense=("price",))
    order = sorted(good, key=lambda line: (int(good[line]["hour"]), line))  # ties keep file order
    n_test = n_validation = round(0.1 * len(order))
    expected = {"test": order[len(order) - n_test:], "validation": order[len(order) - n_test - n_validation:
                                                                         len(order) - n_test]}
    expected["train"] = order[:len(order) - n_test - n_validation]
    dataset = tabular.tabular_array_dataset(options(**fields))
    for split, lines in expected.items():  # blocks are in file order
        assert dataset.splits[split].dense[:, 1].tolist() == [float(good[n]["hour"]) for n in sorted(lines)]

    # ISO-8601 times (naive and with an offset) sort as instants; a column mixing them with numbers is an error.
    (tmp_path / "iso.csv").write_text("y,t,s\n1,2024-01-03,a\n0,2024-01-01T10:00:00,b\n1,2024-01-02T00:00:00Z,a\n"
                                      "0,2024-01-01 09:00:00,b\n1,2024-01-02T01:00:00+02:00,a\n")
    iso = {"dir": str(tmp_path), "files": "iso.csv", "label.column": "y", "sparse.columns": ("s",),
           "split.method": "time", "split.time_column": "t", "split.validation_fraction": 0.2,
           "split.test_fraction": 0.2}
    dataset = tabular.tabular_array_dataset(options(**iso))
    # Instants: line 5 (01-01 09:00), 3 (01-01 10:00), 6 (01-01 23:00 UTC), 4 (01-02 00:00), 2 (01-03).
    assert dataset.splits["test"].ids["s"].size == 1 and dataset.splits["test"].labels.tolist() == [1.0]  # line 2
    assert dataset.splits["validation"].labels.tolist() == [1.0]  # line 4
    (tmp_path / "bad_time.csv").write_text("y,t,s\n1,5,a\n0,soon,b\n0,6,a\n0,7,b\n1,,a\n1,8,b\n")
    with tabular.prepare_tabular(options(**{**iso, "files": "bad_time.csv"})) as prepared:
        assert [(n, r) for _, n, r in prepared.report.first_skipped] == [
            (3, "time column 't' = 'soon' is neither a number nor an ISO-8601 date/time"),
            (6, "time column 't' is empty")]
    (tmp_path / "mixed.csv").write_text("y,t,s\n1,2024-01-03,a\n0,14102100,b\n1,5,a\n0,6,b\n1,7,a\n")
    with pytest.raises(DataError, match=r"mixes numbers .*mixed\.csv, line / row 3.* and ISO-8601 dates"):
        tabular.prepare_tabular(options(**{**iso, "files": "mixed.csv"}))


def test_a_time_split_on_a_constant_column_is_refused(tmp_path):
    # One value for every row: the "time" split would be file order. Two values are a time split (ties: file order).
    fields = {"dir": str(tmp_path), "label.column": "y", "sparse.columns": ("s",), "split.method": "time",
              "split.time_column": "t", "split.validation_fraction": 0.25, "split.test_fraction": 0.25}
    for name, value, shown in (("hour", "14102100", "14102100"), ("iso", "2024-01-02T03:04:05", "2024-01-02T03:04:05"),
                               ("float", "0.5", "0.5")):
        (tmp_path / f"{name}.csv").write_text("y,t,s\n" + "".join(f"{i % 2},{value},a\n" for i in range(8)))
        with pytest.raises(DataError, match=re.escape(
                f"data.split.time_column 't' holds one value ({shown}) in all 8 valid rows, so a time split would cut "
                "them in file order; set data.split.method to 'random' (or 'files'), or data.split.time_column to a "
                "column whose values vary")):
            tabular.prepare_tabular(options(**fields, files=f"{name}.csv"))
    (tmp_path / "two.csv").write_text("y,t,s\n" + "".join(f"{i % 2},{5 + (i == 7)},a\n" for i in range(8)))
    with tabular.prepare_tabular(options(**fields, files="two.csv")) as prepared:
        assert prepared.split_rows == {"train": 4, "validation": 2, "test": 2}
        assert all_blocks(prepared, "test").labels.tolist() == [0.0, 1.0]  # line 8 (t 5, by file order), line 9 (t 6)


def test_files_split_with_a_carved_validation_split():
    libfm = {"format": "libsvm", "files": "", "split.method": "files", "split.train_files": "frappe.train.libfm",
             "split.test_files": "frappe.test.libfm", "split.validation_fraction": 0.25, "split.seed": 5}
    with tabular.prepare_tabular(options(**libfm)) as prepared:
        # train.libfm's 36 valid lines are cut at random into train and validation; test is its own file.
        assert prepared.split_rows["train"] + prepared.split_rows["validation"] == 36
        assert prepared.split_rows["test"] == 12
        good = [n for n in range(1, 41) if n not in (5, 11, 16, 20)]
        assert prepared.split_rows["validation"] == sum(py_uniform(5, row) < 0.25 for row in range(len(good)))
    with pytest.raises(ConfigError, match=r"data\.split\.test_files: .*frappe\.train\.libfm is also in "
                                          r"data\.split\.train_files"):
        tabular.prepare_tabular(options(**{**libfm, "split.test_files": "frappe.t*.libfm"}))


# ----------------------------------------------------------------------------------------------------------------------
# libSVM / libFM / libFFM
# ----------------------------------------------------------------------------------------------------------------------


def test_libfm_positional_fields_against_a_token_parse():
    chunks, report = parse(options(format="libsvm", files="frappe.train.libfm"))
    assert [(n, r) for _, n, r in report.first_skipped] == [
        (5, "9 index:value pairs, expected 10 like the first line of the first file (data.libsvm.fields="
            "'positional' needs the same number on every line)"),
        (11, "token '200' is not index:value"),
        (16, "token '102:0.5': index 102 has a value other than 0 or 1; list the index in "
             "data.libsvm.dense_indices if it is a dense feature"),
        (20, "label = 'nan' is NaN")]
    lines = (FIXTURES / "frappe.train.libfm").read_text().splitlines()
    good = [(n, line.split()) for n, line in enumerate(lines, 1) if n not in (5, 11, 16, 20)]
    assert np.concatenate([c.labels for c in chunks]).tolist() == [float(t[0] == "1") for _, t in good]
    for k in range(10):
        assert rows_of(chunks, f"f{k}") == [int(t[1 + k].split(":")[0]) for _, t in good]


def test_libffm_fields_dense_index_and_absent_fields():
    chunks, report = parse(options(format="libsvm", files="clicks.libffm", **{"libsvm.fields": "ffm",
                                                                              "libsvm.dense_indices": (99,)}))
    lines = (FIXTURES / "clicks.libffm").read_text().splitlines()
    second = lines[7].split()[3]  # line 8: "1:12:1" was inserted before the line's own field-1 token
    assert [(n, r) for _, n, r in report.first_skipped] == [
        (3, "token '0:5' is not field:index:value"),
        (8, f"token '{second}': field 1 appears twice in the line (data.libsvm.fields='bag' reads multi-hot lines)"),
        (12, f"the line has no label: its first token '{lines[11].split()[0]}' is a feature")]
    good = [line.split() for n, line in enumerate(lines, 1) if n not in (3, 8, 12)]
    fields = [{t.split(":")[0]: t.split(":") for t in tokens[1:]} for tokens in good]
    assert sorted(chunks[0].sparse) == ["f0", "f1", "f2", "f3"]  # field 4 only holds the dense index 99
    np.testing.assert_allclose(np.concatenate([c.dense for c in chunks])[:, 0], [float(f["4"][2]) for f in fields])
    assert rows_of(chunks, "f3") == [int(f["3"][1]) if "3" in f else tabular_formats.MISSING_INDEX_KEY
                                     for f in fields]

    bag = options(format="libsvm", files="frappe.test.libfm", **{"libsvm.fields": "bag"})
    chunks, _ = parse(bag)
    lines = (FIXTURES / "frappe.test.libfm").read_text().splitlines()
    assert rows_of(chunks, "features") == [[int(t.split(":")[0]) for t in line.split()[1:]] for line in lines]


def test_libsvm_bad_tokens_and_dense_indices(tmp_path):
    (tmp_path / "small.libsvm").write_text("1 3:1 7:0.5 9:1\n0 a:1 7:1\n1 3:x\n\n-1 3:1 7:2.5 7:1\n0 3:1 9:1 \n")
    chunks, report = parse(options(dir=str(tmp_path), format="libsvm", files="small.libsvm",
                                   **{"libsvm.fields": "bag", "libsvm.dense_indices": (7,)}))
    assert [(n, r) for _, n, r in report.first_skipped] == [
        (2, "token 'a:1': the index is not a non-negative integer of at most 18 digits"),
        (3, "token '3:x': the value is not a finite number"),
        (5, "token '7:1': dense index 7 appears twice in the line")]
    assert report.blank_lines == 1 and report.rows_kept == 2
    assert rows_of(chunks, "features") == [[3, 9], [3, 9]]  # dense index 7 is no sparse value
    np.testing.assert_allclose(chunks[0].dense[:, 0], [0.5, 0.0])  # absent -> dense.missing


# ----------------------------------------------------------------------------------------------------------------------
# Errors a user can act on
# ----------------------------------------------------------------------------------------------------------------------


def test_binary_garbage_as_csv_is_a_data_error_naming_the_file(tmp_path):
    """A binary file given as CSV (a PNG's first bytes: a '\\r' inside line 1) was a `_csv.Error` traceback from the
    header / field-count read; now a DataError naming the file and line, with or without a header, plain or gzip."""
    garbage = b"\x89PNG\r\x1a\x00\x00\x00\rIHDR\xff\xfe,\x00\r,x\n" + bytes(range(256)) * 8
    with pytest.raises(csv.Error):  # the oracle: Python's csv module cannot read line 1 either
        next(csv.reader([garbage.split(b"\n")[0].decode("utf-8", errors="replace")]))
    (tmp_path / "image.csv").write_bytes(garbage)
    (tmp_path / "image.csv.gz").write_bytes(gzip.compress(garbage))
    for name in ("image.csv", "image.csv.gz"):
        for header in (True, False):
            fields = {"dir": str(tmp_path), "files": name, "csv.header": header, "label.column": "click" if header
                      else "0", "sparse.columns": ("a",) if header else ("1",)}
            with pytest.raises(DataError, match=rf"{re.escape(str(tmp_path / name))}: line 1 cannot be read as CSV "
                                                r"\(.*\); is this a CSV file\? \(data.files, data.format\)"):
                tabular.prepare_tabular(options(**fields))


def test_config_errors_name_their_key():
    cases = [
        ({"split.test_fraction": 1.5}, r"data\.split\.test_fraction: must be in \[0, 1\), got 1\.5"),
        ({"csv.delimtr": ";"}, r"data\.csv\.delimtr: is not a tabular data option"),
        ({"sparse.columns": ("a",), "dense.columns": ("a",)},
         r"data\.sparse\.columns: column 'a' is also in data\.dense\.columns"),
        ({"sparse.columns": ("a",), "sparse.vocab": "hash"}, r"data\.sparse\.hash_buckets: must be in \[1, 2\*\*31\)"),
        ({"sparse.columns": ("a",), "dense.transform": "log1p+clip", "dense.clip_min": 0.0},
         r"data\.dense\.transform: 'log1p\+clip': the steps run in the fixed order clip, log1p, standardise"),
        ({"sparse.columns": ("a",), "split.method": "time"}, r"data\.split\.time_column: must name the column"),
        ({"sparse.columns": ("a",), "sparse.multi_valued": ("b",)},
         r"data\.sparse\.multi_valued: names \['b'\], which are not in data\.sparse\.columns"),
        ({"sparse.columns": ()}, r"data\.sparse\.columns: is empty"),
    ]
    for fields, message in cases:
        with pytest.raises(ConfigError, match=message):
            options(**fields)


def test_data_errors_name_files_columns_and_what_the_split_needs(tmp_path):
    with pytest.raises(DataError, match=r"clicks\.csv: the header has no column \['price2'\]; its columns are "
                                        r"\['id', 'click', .*'tags'\]"):
        tabular.prepare_tabular(options(**{**CLICKS, "dense.columns": ("price2",)}))
    with pytest.raises(ConfigError, match=r"data\.files: pattern 'nothing\*\.csv' matches no file in"):
        tabular.prepare_tabular(options(**{**CLICKS, "files": "nothing*.csv"}))
    lines = (FIXTURES / "clicks.csv").read_text().splitlines()[:10]  # 7 valid rows (a blank and a bad line)
    (tmp_path / "clicks.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"data\.split: validation has 0 rows \(validation_fraction 0\.05 before the "
                                        r"test rows of 7 valid rows in clicks\.csv\); provide more rows or set "
                                        r"data\.split\.validation_fraction so each split gets at least one row"):
        tabular.prepare_tabular(options(**{**CLICKS, "dir": str(tmp_path), "split.method": "time",
                                           "split.time_column": "hour", "split.validation_fraction": 0.05}))
    (tmp_path / "empty.csv").write_bytes(b"")
    shutil.copy(FIXTURES / "clicks.csv", tmp_path / "all.csv")
    both = {**CLICKS, "dir": str(tmp_path), "files": "empty.csv,all.csv"}
    with tabular.prepare_tabular(options(**both)) as prepared:
        assert prepared.report.empty_files == [str(tmp_path / "empty.csv")]
    with pytest.raises(DataError, match=r"empty\.csv: the file is empty; expected CSV rows"):
        tabular.prepare_tabular(options(**both, strict=True))


# ----------------------------------------------------------------------------------------------------------------------
# Config, the TFDS builder and the example configs
# ----------------------------------------------------------------------------------------------------------------------


def test_options_round_trip_through_the_config_dict():
    opts = options(**CLICKS, **{"dense.transform": "clip+log1p", "dense.clip_min": 0.0,
                                "sparse.overrides": {"C14": {"vocab": "hash", "hash_buckets": 10}}})
    assert tabular.TabularOptions.from_config(opts.to_dict()) == opts
    assert opts.vocab_settings("C14") == tabular.VocabSettings("hash", 1, 10)
    assert opts.dense_steps("price") == ("clip", "log1p")


def test_end_to_end_through_the_tfds_builder_into_prepared_dataset(tmp_path):
    data = config(**CLICKS)
    data.prepared_dir = str(tmp_path / "prepared")
    dataset = make_dataset(data, seed=0)
    in_memory = tabular.tabular_array_dataset(options(**CLICKS))
    for split in tabular.SPLITS:
        assert dataset.num_examples(split) == in_memory.splits[split].size
    got = concatenate(list(dataset.eval_batches(8, "validation")))
    want = in_memory.splits["validation"]
    np.testing.assert_array_equal(got.dense, want.dense)
    assert all(np.array_equal(got.ids[f], want.ids[f]) for f in want.ids)
    info = dataset.info()
    assert info["parse_report"]["skipped"] == 6 and info["parse_report"]["first_skipped"][0]["line"] == 9
    # What the run prints when it opens the data (recjax/data/builders.py open_prepared logs these lines).
    assert "data: dense transform (data.dense.transform, per column data.dense.transforms): standardise for price" \
        in dataset.report_lines()
    assert info["tabular_stats"]["split_rows"] == {s: in_memory.splits[s].size for s in tabular.SPLITS}
    counts = np.load(pathlib.Path(dataset.builder.data_dir) / "index_counts.npz")
    assert int(counts["site_id"].sum()) == in_memory.splits["train"].size
    assert make_dataset(data, seed=0).builder.data_dir == dataset.builder.data_dir  # prepared once, then reused


def test_example_configs_run_on_the_fixtures(tmp_path):
    from experiments.configs import dlrm_csv_clicks, dlrm_libfm
    from recjax.train import train_and_evaluate

    shutil.copy(FIXTURES / "clicks.csv", tmp_path / "clicks.csv")
    for module, files in ((dlrm_csv_clicks, "clicks.csv"), (dlrm_libfm, None)):
        cfg = module.get_config()
        cfg.data.dir = str(FIXTURES)
        if files:
            cfg.data.files = files
        cfg.data.prepared_dir = str(tmp_path / "prepared")
        cfg.train.epochs, cfg.train.steps, cfg.train.eval_every = None, 4, 2
        cfg.train.batch_size, cfg.train.progress_bar = 8, False
        summary = train_and_evaluate(cfg, tmp_path / module.__name__.rsplit(".", 1)[-1])
        assert math.isfinite(summary["test"]["logloss"]) and summary["parse_report"]["skipped"] > 0
