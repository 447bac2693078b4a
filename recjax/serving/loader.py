r"""Load a recjax export and score rows with jax and numpy only: no training code, no config, no recjax install.

    import serving_loader                         # the copy inside the export directory (or recjax.serving.loader)
    model = serving_loader.load("runs/ml100k/export")
    scores, errors = model.score_rows(["196\t242", {"dense": [0.1, -0.3], "ids": {"user": 5, ...}}])

An export directory (written by recjax/serving/export.py) holds
    export.json          what it is: the features and dense columns, the tables' format and bytes, where each argument
                         of the scoring function is stored, and the input spec (how raw rows become ids)
    score.jax_export     the scoring function serialized with `jax.export` (StableHLO), taking (tables, dense params,
                         routing arrays, dense f32[B, D], ids {feature: i32[B, L]}, lengths {feature: i32[B]}) ->
                         click probabilities f32[B]; the batch dimension B is symbolic
    arrays/              every argument but the batch, one .npy each (tables in their stored format)
    vocab/               the input spec's arrays (vocabularies, per-user / per-item tables)
    serving_loader.py    a copy of this file

Rows a model scores (`score_rows`), each independently:
    encoded   {"dense": [D numbers], "ids": {feature: id or [ids]}}: every feature named, a bag of at most its
              bag size, ids in [0, vocab size) (any int32 for hashed features)
    raw       a string in the dataset's own line format (export.json "input.kind"):
              criteo     the 40 tab-separated fields of a Criteo line (label, I1..I13, C1..C26), or the 39 without the
                         label; the training vocabulary (rare / unseen ids -> 0) or hashing, dense log(max(x, 0) + 1)
              movielens  a ratings-file line, "user<sep>item" with optional rating and timestamp (sep: tab for 100K,
                         "::" for 1M, "," for latest-small); the user's and movie's features from the training data
              tabular    (CSV data) a line with the data file's columns (input.columns; the label may be left out),
                         each cell read as the tabular builder reads it: the train vocabulary (rare / unseen -> 0) or
                         hashing, the dense columns' clip / log1p and train standardisation (`TabularCsvInput`);
                         (libSVM data) a libSVM / libFM / libFFM line, the label optional (`TabularLibsvmInput`)
A bad row is an error naming the row and field; the other rows of the same call are still scored.
"""

import csv
import dataclasses
import json
import math
import pathlib
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

FORMAT_VERSION = 1
INT32_MAX = 2**31 - 1


class RowError(ValueError):
    """One row cannot be scored: `field` names what is wrong (a feature, "dense[2]", "ids", "row")."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclasses.dataclass
class EncodedRows:
    """The valid rows of a request, encoded: dense f32[n, D], ids {feature: i32[n, L]}, lengths {feature: i32[n]};
    `index` i[n]: each one's position in the request."""

    dense: np.ndarray
    ids: dict[str, np.ndarray]
    lengths: dict[str, np.ndarray]
    index: list[int]

    @property
    def size(self) -> int:
        return len(self.index)


# ------------------------------------------------------------------------------------------------ encoders
class EncodedInput:
    """Rows given as {"dense": [...], "ids": {feature: id | [ids]}}."""

    def __init__(self, features: Sequence[dict], num_dense: int):
        self.features = list(features)
        self.names = [f["name"] for f in features]
        self.num_dense = num_dense

    def dense(self, values: Any) -> np.ndarray:
        if not isinstance(values, list) or len(values) != self.num_dense:
            got = f"{len(values)} values" if isinstance(values, list) else type(values).__name__
            raise RowError("dense", f"must be a list of {self.num_dense} numbers, got {got}")
        for k, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise RowError(f"dense[{k}]", f"must be a number, got {json.dumps(v)[:40]}")
        try:
            with np.errstate(over="ignore"):  # past float32's range is inf, refused below
                out = np.array(values, np.float32)
        except OverflowError:  # an int past float64's range
            out = np.array([v if abs(v) < 2**128 else math.inf for v in values], np.float32)
        bad = np.flatnonzero(~np.isfinite(out))
        if len(bad):
            raise RowError(f"dense[{bad[0]}]", f"must be finite (in float32), got {values[bad[0]]}")
        return out

    def bag(self, feature: dict, value: Any) -> list[int]:
        name, bag_size = feature["name"], feature["bag_size"]
        bag = value if isinstance(value, list) else [value]
        if len(bag) > bag_size:
            raise RowError(name, f"a bag of {len(bag)} ids; this feature holds at most {bag_size}")
        for v in bag:
            if isinstance(v, bool) or not isinstance(v, int):
                raise RowError(name, f"ids must be integers, got {json.dumps(v)[:40]}")
            if feature["any_id"]:
                if not -INT32_MAX - 1 <= v <= INT32_MAX:
                    raise RowError(name, f"id {v} is outside int32")
            elif not 0 <= v < feature["vocab_size"]:
                raise RowError(name, f"id {v} is outside [0, {feature['vocab_size']})")
        return bag

    def encode(self, row: Any) -> tuple[np.ndarray, dict[str, list[int]]]:
        if not isinstance(row, dict):
            raise RowError("row", f"must be an object {{\"dense\": [...], \"ids\": {{...}}}}, got "
                                  f"{type(row).__name__}")
        unknown = sorted(set(row) - {"dense", "ids"})
        if unknown:
            raise RowError(unknown[0], "unknown key; a row has \"dense\" and \"ids\"")
        ids = row.get("ids")
        if not isinstance(ids, dict):
            raise RowError("ids", "must be an object {feature: id or [ids]}")
        extra = sorted(set(ids) - set(self.names))
        if extra:
            raise RowError(str(extra[0]), f"not a feature of this model; its features are {self.names}")
        missing = [n for n in self.names if n not in ids]
        if missing:
            raise RowError(missing[0], "missing (every feature needs an id or a bag, possibly [])")
        dense = self.dense(row.get("dense", [] if self.num_dense == 0 else None))
        return dense, {f["name"]: self.bag(f, ids[f["name"]]) for f in self.features}


class CriteoInput:
    """Criteo lines: label (optional), I1..I13 (integers or empty), C1..C26 (8 hex digits or empty)."""

    NUM_DENSE, NUM_SPARSE = 13, 26
    MISSING = 1 << 32  # an empty category's raw key (recjax/data/criteo.py MISSING_CATEGORY)
    _HEX = re.compile(r"[0-9a-fA-F]{8}")
    _INT = re.compile(r"-?[0-9]{1,19}")

    def __init__(self, spec: dict, arrays: dict[str, np.ndarray], features: Sequence[dict]):
        self.mode, self.max_index = spec["vocab"], spec.get("max_index")
        self.names = [f["name"] for f in features]
        self.keys = [arrays.get(f"{n}/keys") for n in self.names]
        self.indices = [arrays.get(f"{n}/indices") for n in self.names]

    def encode(self, line: str) -> tuple[np.ndarray, dict[str, list[int]]]:
        fields = line.rstrip("\r\n").split("\t")
        if len(fields) == 1 + self.NUM_DENSE + self.NUM_SPARSE:
            fields = fields[1:]  # the label is not scored
        if len(fields) != self.NUM_DENSE + self.NUM_SPARSE:
            raise RowError("row", f"a Criteo line has 40 tab-separated fields (39 without the label), got "
                                  f"{len(fields)}")
        values = np.zeros(self.NUM_DENSE, np.int64)
        for k, text in enumerate(fields[:self.NUM_DENSE]):
            if text == "":
                continue  # missing -> 0
            if not self._INT.fullmatch(text) or not -2**63 <= int(text) < 2**63:
                raise RowError(f"I{k + 1}", f"{text[:40]!r} is not an integer (or empty)")
            values[k] = max(int(text), 0)
        dense = np.log(values.astype(np.float32) + np.float32(1))  # DLRM's log(max(x, 0) + 1), in float32
        ids = {}
        for k, text in enumerate(fields[self.NUM_DENSE:]):
            name = self.names[k]
            if text == "":
                key = self.MISSING
            elif self._HEX.fullmatch(text):
                key = int(text, 16)
            else:
                raise RowError(name, f"{text[:40]!r} is not 8 hex digits (or empty)")
            if self.mode == "hash":
                ids[name] = [key % self.max_index]
            else:  # frequency: the train vocabulary, 0 for a rare or unseen value
                keys = self.keys[k]
                at = int(np.searchsorted(keys, key))
                ids[name] = [int(self.indices[k][at]) if at < keys.size and keys[at] == key else 0]
        return dense, ids


class MovieLensInput:
    """Ratings-file lines "user<sep>item[<sep>rating<sep>timestamp]": the user's and the movie's features are the
    training data's (per-user and per-item tables in the export)."""

    def __init__(self, spec: dict, arrays: dict[str, np.ndarray], features: Sequence[dict], dense_names: list[str]):
        self.separator = spec["separator"]
        self.user_ids, self.item_ids = arrays["users/raw_ids"], arrays["items/raw_ids"]
        self.entity_of = spec["entity_of"]  # feature or dense column -> "user" / "item"
        self.arrays = arrays
        self.features = list(features)
        self.dense_names = dense_names

    def _index(self, raw: np.ndarray, text: str, field: str) -> int:
        if not re.fullmatch(r"-?[0-9]{1,18}", text.strip()):
            raise RowError(field, f"{text[:40]!r} is not an integer id")
        value = int(text)
        at = int(np.searchsorted(raw, value))
        if at >= raw.size or raw[at] != value:
            raise RowError(field, f"{field} id {value} is not in the training data (the model has no row for it)")
        return at

    def encode(self, line: str) -> tuple[np.ndarray, dict[str, list[int]]]:
        fields = line.rstrip("\r\n").split(self.separator)
        if len(fields) not in (2, 4):
            raise RowError("row", f"a ratings line has user{self.separator}item (and optionally rating and timestamp), "
                                  f"{len(fields)} {self.separator!r}-separated fields given")
        index = {"user": self._index(self.user_ids, fields[0], "user"),
                 "item": self._index(self.item_ids, fields[1], "item")}
        ids = {}
        for f in self.features:
            name = f["name"]
            if name in index:
                ids[name] = [index[name]]
                continue
            entity = self.entity_of[name]
            table = self.arrays[f"{entity}s/{name}"]
            if table.ndim == 1:
                ids[name] = [int(table[index[entity]])]
            else:  # a bag: ids and lengths per entity
                length = int(self.arrays[f"{entity}s/{name}_lengths"][index[entity]])
                ids[name] = [int(v) for v in table[index[entity], :length]]
        dense = np.asarray([self.arrays[f"{self.entity_of[c]}s/{c}"][index[self.entity_of[c]]]
                            for c in self.dense_names], np.float32)
        return dense, ids


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser (recjax/data/vocabulary.py `mix64`), on Python ints modulo 2**64."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def string_key(data: bytes) -> int:
    """A CSV cell's raw key, as recjax/data/vocabulary.py `string_keys` computes it: h = mix64(golden + len), then
    h = mix64(h ^ w) for each little-endian 8-byte word w (the last one zero-padded); the key is h's low 63 bits."""
    h = _mix64((0x9E3779B97F4A7C15 + len(data)) & _MASK64)
    for at in range(0, len(data), 8):
        h = _mix64(h ^ int.from_bytes(data[at:at + 8].ljust(8, b"\0"), "little"))
    return h & ((1 << 63) - 1)


class TabularInput:
    """What CSV and libSVM rows of a tabular run share, as the tabular builder does it (recjax/data/tabular.py,
    tabular_formats.py): a dense value is missing (data.dense.missing), NaN (imputed or a bad row, data.dense.nan)
    or a number, then its column's clip / log1p chain and the train split's standardisation; a sparse value's raw
    key maps to the train frequency vocabulary's id (0 for a rare or unseen value) or to the key modulo the hash
    buckets."""

    _FLOAT = re.compile(r"(?i)^[+-]?(([0-9]+\.?[0-9]*|\.[0-9]+)(e[+-]?[0-9]+)?|inf|infinity|nan)$")

    def __init__(self, spec: dict, arrays: dict[str, np.ndarray]):
        self.spec = spec
        self.missing_markers, self.nan_markers = set(spec["missing_markers"]), set(spec["nan_markers"])
        self.shift, self.scale = arrays["dense/shift"], arrays["dense/scale"]
        self.sparse = spec["sparse"]
        self.feature = {f["name"]: f for f in self.sparse}
        self.vocab = {f["name"]: (arrays.get(f"{f['name']}/keys"), arrays.get(f"{f['name']}/ids")) for f in self.sparse}

    def parse_number(self, field: str, text: str) -> float | None:
        """A number as pyarrow's converter reads it (surrounding blanks ignored), NaN included; None if `text` is a
        missing marker; a RowError if it is not a number or is infinite."""
        if text in self.missing_markers:
            return None
        if text in self.nan_markers:
            return math.nan
        for candidate in (text, text.strip(" \t")):
            if self._FLOAT.match(candidate):
                value = float(candidate)
                if math.isinf(value):
                    raise RowError(field, f"{text[:40]!r} is infinite")
                return value
        raise RowError(field, f"{text[:40]!r} is not a number")

    def dense_value(self, j: int, field: str, value: float | None) -> np.float32:
        """Dense column j's model input from its raw value (None: missing)."""
        spec, column = self.spec, self.spec["dense"][j]
        if value is not None and math.isnan(value):
            if spec["nan"] == "skip":
                raise RowError(field, "is NaN (data.dense.nan='skip')")
            value = None
        value = float(spec["missing"]) if value is None else value
        if "clip" in column["steps"]:
            value = min(max(value, -math.inf if spec["clip_min"] is None else spec["clip_min"]),
                        math.inf if spec["clip_max"] is None else spec["clip_max"])
        if "log1p" in column["steps"]:
            if value <= -1:
                raise RowError(field, f"{value:g}: log1p needs values > -1 (after clip)")
            value = float(np.log1p(np.float64(value)))
        # The builder keeps the chain's result in float32, then standardises it in float64 (tabular.py _finalize).
        return np.float32((np.float64(np.float32(value)) - self.shift[j]) / self.scale[j])

    def ids(self, name: str, keys: Sequence[int]) -> list[int]:
        feature = self.feature[name]
        if feature["vocab"] == "hash":
            return [k % feature["hash_buckets"] for k in keys]
        known, index = self.vocab[name]  # the train vocabulary; 0 for a rare or unseen value
        at = np.searchsorted(known, np.asarray(keys, np.int64))
        return [int(index[a]) if a < known.size and known[a] == k else 0
                for a, k in zip(at.tolist(), keys, strict=True)]

    def bag(self, name: str, keys: list[int]) -> list[int]:
        """A multi-valued feature's keys, truncated to data.sparse.max_bag_size as the builder truncates."""
        if self.spec["max_bag_size"]:
            keys = keys[:self.spec["max_bag_size"]]
        if len(keys) > self.feature[name]["bag_size"]:
            raise RowError(name, f"a bag of {len(keys)} values; this feature holds at most "
                                 f"{self.feature[name]['bag_size']}")
        return keys


class TabularCsvInput(TabularInput):
    """CSV rows: one line with the data file's columns (the label's field may be left out); a sparse cell's UTF-8
    bytes are its raw key (a multi-valued cell split at the separator, empty items dropped)."""

    def __init__(self, spec: dict, arrays: dict[str, np.ndarray]):
        super().__init__(spec, arrays)
        self.columns = spec["columns"]
        self.label_at = self.columns.index(spec["label"]) if spec["label"] in self.columns else None

    def fields(self, line: str) -> dict[str, str]:
        try:
            fields = next(csv.reader([line.rstrip("\r\n")], delimiter=self.spec["delimiter"]), [])
        except csv.Error as error:
            raise RowError("row", f"cannot be read as CSV ({error})") from None
        n = len(self.columns)
        if len(fields) == n - 1 and self.label_at is not None:
            fields.insert(self.label_at, "")  # the label is not scored
        if len(fields) != n:
            raise RowError("row", f"a row has the data's {n} {self.spec['delimiter']!r}-separated columns "
                                  f"{self.columns} ({n - 1} without the label {self.spec['label']!r}), got "
                                  f"{len(fields)} fields")
        return dict(zip(self.columns, fields, strict=True))

    def encode(self, line: str) -> tuple[np.ndarray, dict[str, list[int]]]:
        cells = self.fields(line)
        dense = np.asarray([self.dense_value(j, c["name"], self.parse_number(c["name"], cells[c["name"]]))
                            for j, c in enumerate(self.spec["dense"])], np.float32)
        ids = {}
        for feature in self.sparse:
            name, text = feature["name"], cells[feature["name"]]
            values = [v for v in text.split(self.spec["separator"]) if v] if feature["multi_valued"] else [text]
            keys = [string_key(v.encode()) for v in values]
            ids[name] = self.ids(name, self.bag(name, keys) if feature["multi_valued"] else keys)
        return dense, ids


class TabularLibsvmInput(TabularInput):
    """libSVM / libFM / libFFM lines "[label] idx:val ..." (or field:idx:val), tokens separated by blanks: an index
    is its own raw key; a dense index's value is its dense feature (absent: missing); any other value is 0 or 1,
    and 0 reads as absent. positional: the k-th pair is feature f<k> (every line has as many pairs as the model has
    features); ffm: field f's pair is feature f<f> (an absent field is missing); bag: every index with value 1."""

    MISSING_INDEX_KEY = 2**63 - 1  # an absent field (recjax/data/tabular_formats.py)
    _UINT = re.compile(r"[0-9]{1,18}")

    def __init__(self, spec: dict, arrays: dict[str, np.ndarray]):
        super().__init__(spec, arrays)
        self.mode = spec["fields"]
        self.dense_at = {int(c["index"]): j for j, c in enumerate(spec["dense"])}

    def _uint(self, token: str, text: str, what: str) -> int:
        if not self._UINT.fullmatch(text):
            raise RowError(token, f"the {what} is not a non-negative integer of at most 18 digits")
        return int(text)

    def encode(self, line: str) -> tuple[np.ndarray, dict[str, list[int]]]:
        tokens = [t for t in re.split(r"[ \t\r\n]+", line) if t]  # the builder's separators, no other blank
        if tokens and ":" not in tokens[0]:
            tokens = tokens[1:]  # the label is not scored
        ffm = self.mode == "ffm"
        dense_values: dict[int, float] = {}
        pairs: list[tuple[int, int, int]] = []  # (field, index, value) of the sparse tokens, in line order
        for k, text in enumerate(tokens):
            token = f"token {k + 1}"
            parts = text.split(":")
            if len(parts) != (3 if ffm else 2):
                raise RowError(token, f"{text[:40]!r} is not {'field:index:value' if ffm else 'index:value'}")
            field = self._uint(token, parts[0], "field") if ffm else 0
            index = self._uint(token, parts[-2], "index")
            value = 1.0 if parts[-1] == "1" else 0.0 if parts[-1] == "0" else self.parse_number(token, parts[-1])
            if value is None:
                raise RowError(token, f"{text[:40]!r}: the value is not a finite number")
            if index in self.dense_at:
                if index in dense_values:
                    raise RowError(token, f"dense index {index} appears twice in the line")
                dense_values[index] = value
                continue
            if math.isnan(value) or value not in (0.0, 1.0):
                raise RowError(token, f"{text[:40]!r}: index {index} has a value other than 0 or 1")
            pairs.append((field, index, int(value)))
        dense = np.asarray([self.dense_value(j, c["name"], dense_values.get(int(c["index"])))
                            for j, c in enumerate(self.spec["dense"])], np.float32)
        key = lambda index, value: index if value == 1 else self.MISSING_INDEX_KEY  # noqa: E731
        if self.mode == "bag":
            name = self.sparse[0]["name"]
            return dense, {name: self.ids(name, self.bag(name, [index for _, index, value in pairs if value == 1]))}
        if self.mode == "positional":
            if len(pairs) != len(self.sparse):
                raise RowError("row", f"{len(pairs)} index:value pairs; this model's lines have {len(self.sparse)} "
                                      "(data.libsvm.fields='positional')")
            return dense, {f"f{k}": self.ids(f"f{k}", [key(index, value)]) for k, (_, index, value) in
                           enumerate(pairs)}
        keys = dict.fromkeys(self.feature, self.MISSING_INDEX_KEY)
        seen = set()
        for field, index, value in pairs:
            name = f"f{field}"
            if name not in keys:
                raise RowError(name, f"field {field} is not a feature of this model; its fields are {list(keys)}")
            if name in seen:
                raise RowError(name, f"field {field} appears twice in the line")
            seen.add(name)
            keys[name] = key(index, value)
        return dense, {name: self.ids(name, [k]) for name, k in keys.items()}


# --------------------------------------------------------------------------------------------------- model
def _skeleton(tree: Any, directory: pathlib.Path) -> Any:
    """Nested dicts whose leaves are .npy paths -> the same dicts holding the arrays (memory-mapped)."""
    if isinstance(tree, dict):
        return {k: _skeleton(v, directory) for k, v in tree.items()}
    return np.load(directory / tree, mmap_mode="r")


class ServingModel:
    """An export, loaded: `score_rows` (raw or encoded rows -> probabilities and row errors), `encode` and
    `score_arrays` (the two halves, for a server that batches several requests' rows)."""

    def __init__(self, directory: str | pathlib.Path):
        self.directory = pathlib.Path(directory)
        manifest_path = self.directory / "export.json"
        if not manifest_path.is_file():
            raise FileNotFoundError(f"{self.directory} is not a recjax export: it has no export.json (write one with "
                                    "python -m experiments.export --workdir=RUN --out=DIR)")
        self.manifest = manifest = json.loads(manifest_path.read_text())
        if manifest.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{manifest_path}: export format {manifest.get('format_version')}, this loader reads "
                             f"{FORMAT_VERSION}; export the run again")
        self.features = manifest["features"]
        self.feature_names = [f["name"] for f in self.features]
        self.num_dense = int(manifest["num_dense"])
        self.table_format = manifest["table_format"]
        self.exported = jax.export.deserialize(bytearray((self.directory / "score.jax_export").read_bytes()))
        arguments = manifest["arguments"]
        self.constants = self._constants(arguments)
        self._call = jax.jit(self.exported.call)
        spec = manifest["input"]
        vocab = {k: np.load(self.directory / v) for k, v in spec.get("arrays", {}).items()}
        self.encoded_input = EncodedInput(self.features, self.num_dense)
        self.raw_input = None
        if spec["kind"] == "criteo":
            self.raw_input = CriteoInput(spec, vocab, self.features)
        elif spec["kind"] == "movielens":
            self.raw_input = MovieLensInput(spec, vocab, self.features, manifest["dense_names"])
        elif spec["kind"] == "tabular" and spec.get("format") == "csv":
            self.raw_input = TabularCsvInput(spec, vocab)
        elif spec["kind"] == "tabular" and spec.get("format") == "libsvm":
            self.raw_input = TabularLibsvmInput(spec, vocab)

    def _constants(self, arguments: dict) -> tuple:
        """(tables, dense params, routing arrays): all go to the device once; each call sends only the batch."""
        return jax.device_put(tuple(_skeleton(arguments[k], self.directory) for k in ("tables", "params", "aux")))

    # ------------------------------------------------------------------------------------------ encoding
    def encode_row(self, row: Any) -> tuple[np.ndarray, dict[str, list[int]]]:
        """One row -> (dense f32[D], {feature: ids}); RowError naming the field if it cannot be scored."""
        if isinstance(row, str):
            if self.raw_input is None:
                raise RowError("row", f"this model ({self.manifest['input']['kind']} data) takes encoded rows only: "
                                      "{\"dense\": [...], \"ids\": {feature: id or [ids]}}")
            return self.raw_input.encode(row)
        return self.encoded_input.encode(row)

    def encode(self, rows: Sequence[Any]) -> tuple[EncodedRows, list[dict]]:
        """The valid rows as arrays, and an error {"row", "field", "error"} for each other one."""
        good, index, errors = [], [], []
        for i, row in enumerate(rows):
            try:
                good.append(self.encode_row(row))
                index.append(i)
            except RowError as error:
                errors.append({"row": i, "field": error.field, "error": error.message})
            except (ValueError, TypeError, OverflowError) as error:  # anything else a row can hold
                errors.append({"row": i, "field": "row", "error": f"cannot be read: {error}"[:300]})
        # Every feature's padded bags in one array, then a view per feature: three numpy calls per request, not
        # two per row and feature (a request's encoding is part of the server's per-request cost).
        n, sizes = len(good), [f["bag_size"] for f in self.features]
        dense = (np.stack([d for d, _ in good]).astype(np.float32, copy=False) if n
                 else np.zeros((0, self.num_dense), np.float32))
        flat = np.array([[i for name, size in zip(self.feature_names, sizes, strict=True)
                          for i in (bags[name] + [0] * (size - len(bags[name])))] for _, bags in good],
                        np.int32).reshape(n, sum(sizes))
        counts = np.array([[len(bags[name]) for name in self.feature_names] for _, bags in good],
                          np.int32).reshape(n, len(sizes))
        starts = np.cumsum([0, *sizes])
        ids = {name: flat[:, starts[k]:starts[k + 1]] for k, name in enumerate(self.feature_names)}
        lengths = {name: counts[:, k] for k, name in enumerate(self.feature_names)}
        return EncodedRows(dense, ids, lengths, index), errors

    # ------------------------------------------------------------------------------------------- scoring
    def score_arrays(self, dense: np.ndarray, ids: dict[str, np.ndarray], lengths: dict[str, np.ndarray],
                     pad_to: int | None = None) -> np.ndarray:
        """Probabilities f32[n] of encoded rows, computed at batch shape `pad_to` (>= n; None: n). A row's score
        depends on the batch shape in the last bit (XLA's kernels differ by shape), never on the other rows."""
        n = dense.shape[0]
        dense, ids, lengths = pad_rows(dense, ids, lengths, n if pad_to is None else pad_to)
        tables, params, aux = self.constants
        return np.asarray(self._call(tables, params, aux, dense, ids, lengths))[:n]

    def score_rows(self, rows: Sequence[Any]) -> tuple[list[float | None], list[dict]]:
        """(a probability per row, None where the row has an error; the errors)."""
        encoded, errors = self.encode(rows)
        scores: list[float | None] = [None] * len(rows)
        if encoded.size:
            for i, p in zip(encoded.index, self.score_arrays(encoded.dense, encoded.ids, encoded.lengths).tolist(),
                            strict=True):
                scores[i] = p
        return scores, errors

    def describe(self) -> str:
        m = self.manifest
        return (f"{m['source'].get('model', 'model')} on {m['input']['kind']} data, {len(self.features)} features, "
                f"tables {self.table_format} ({m['bytes']['tables'] / 2**20:.2f} MiB)")


def pad_rows(dense: np.ndarray, ids: dict[str, np.ndarray], lengths: dict[str, np.ndarray], size: int
             ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Encoded rows padded to `size` rows: empty bags, zero dense (their scores are dropped)."""
    n = dense.shape[0]
    if size < n:
        raise ValueError(f"{n} rows do not fit a batch of {size}")
    if size > n:
        dense = np.concatenate([dense, np.zeros((size - n, dense.shape[1]), np.float32)])
        ids = {k: np.concatenate([v, np.zeros((size - n, v.shape[1]), np.int32)]) for k, v in ids.items()}
        lengths = {k: np.concatenate([v, np.zeros(size - n, np.int32)]) for k, v in lengths.items()}
    return dense, ids, lengths


def load(directory: str | pathlib.Path) -> ServingModel:
    return ServingModel(directory)


def next_power_of_two(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))
