"""Writes the tabular test fixtures in this folder (deterministic; run from anywhere, then commit the files).

    python tests/data/tabular/make_fixtures.py

clicks.csv          Avazu's layout (id, click, hour, C1, banner_pos, site_*, app_*, device_*, C14-C21) plus two
                    columns of our own, price (dense, some empty) and tags (multi-valued, '|'), comma-separated, a
                    header, 40 data lines; BAD_CSV_LINES lists the malformed ones, line 6 is blank.
clicks_noheader.tsv label, visits (dense), category, city, tags; tab-separated, no header; BAD_TSV_LINES, line 15
                    blank.
frappe.{train,validation,test}.libfm
                    libFM, Frappe's layout: label -1/1 and 10 index:value pairs per line, field k's indices in
                    its own range; the train file has BAD_LIBFM_LINES.
clicks.libffm       libFFM: label field:index:value, fields 0-3 one-hot (field 3 sometimes absent), index 99 of
                    field 4 a dense value; BAD_FFM_LINES.
Everything is made up; nothing comes from a real data set.
"""

import pathlib
import random

HERE = pathlib.Path(__file__).resolve().parent
AVAZU = ["id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id", "app_domain",
         "app_category", "device_id", "device_ip", "device_model", "device_type", "device_conn_type", "C14", "C15",
         "C16", "C17", "C18", "C19", "C20", "C21"]
CSV_HEADER = AVAZU + ["price", "tags"]
BAD_CSV_LINES = {  # line: what is wrong (the header is line 1)
    9: "wrong field count", 13: "empty label", 17: "price 'abc'", 21: "price 'inf'", 25: "unterminated quote",
    30: "label 'nan'",
}
BLANK_CSV_LINES = (6,)
BAD_TSV_LINES = {4: "wrong field count", 10: "visits '12x'", 20: "empty label"}
BLANK_TSV_LINES = (15,)
BAD_LIBFM_LINES = {5: "9 pairs", 11: "token without ':'", 16: "value 0.5", 20: "label 'nan'"}
BAD_FFM_LINES = {3: "token '0:5'", 8: "field 1 twice", 12: "no label"}


def clicks_csv(rng: random.Random) -> str:
    lines = [",".join(CSV_HEADER)]
    for number in range(2, 43):
        if number in BLANK_CSV_LINES:
            lines.append("")
            continue
        hour = 14102100 + (number * 7) % 24
        row = {
            "id": str(10**18 + number * 7919), "click": str(int(rng.random() < 0.3)), "hour": str(hour),
            "C1": rng.choice(["1005", "1002", "1010"]), "banner_pos": rng.choice(["0", "1"]),
            "site_id": rng.choice(["c13da58a", "9362da5c", "e5c15b62", "f6fadfa7"]),
            "site_domain": rng.choice(["a7ace732", "7e6ddce7", "28f00481"]),
            "site_category": rng.choice(["2c63888f", "d015b0dc", "8f7b7676"]),
            "app_id": rng.choice(["16bc1732", "16bc1732", "8a119b9e", ""]),
            "app_domain": rng.choice(["da679f81", "609e467a"]), "app_category": rng.choice(["637d6efa", "bc67ba94"]),
            "device_id": rng.choice(["2f960063", "2f960063", "0787c0de"]),
            "device_ip": f"{rng.randrange(16**8):08x}",
            "device_model": rng.choice(["a78beb7e", "fab36728", "12e74f7b"]),
            "device_type": rng.choice(["1", "0"]), "device_conn_type": rng.choice(["0", "2"]),
            "C14": rng.choice(["15706", "20596", "17753"]), "C15": "320", "C16": "50",
            "C17": rng.choice(["1722", "2161", "1993"]), "C18": rng.choice(["0", "2", "3"]),
            "C19": rng.choice(["35", "1327"]), "C20": rng.choice(["-1", "100084", "100148"]),
            "C21": rng.choice(["79", "157", "61"]),
            "price": rng.choice(["", "0.5", "1.25", "3", "10", "0", "2.5e1"]),
            "tags": rng.choice(["", "news", "news|sport", "sport|music|news", "a|b|c|d|e"]),
        }
        problem = BAD_CSV_LINES.get(number)
        if problem == "empty label":
            row["click"] = ""
        elif problem == "label 'nan'":
            row["click"] = "nan"
        elif problem == "price 'abc'":
            row["price"] = "abc"
        elif problem == "price 'inf'":
            row["price"] = "inf"
        elif problem == "unterminated quote":
            row["site_domain"] = '"7e6ddce7'
        if number == 28:
            row["site_domain"] = '"28f0,0481"'  # a quoted delimiter: one field
        fields = [row[c] for c in CSV_HEADER]
        if problem == "wrong field count":
            del fields[5]
        lines.append(",".join(fields))
    return "\n".join(lines) + "\n"


def clicks_tsv(rng: random.Random) -> str:
    lines = []
    for number in range(1, 31):
        if number in BLANK_TSV_LINES:
            lines.append("")
            continue
        fields = [str(int(rng.random() < 0.4)), rng.choice(["", "0", "1", "3", "7", "42"]),
                  rng.choice(["shoes", "books", "toys", ""]), rng.choice(["Paris", "Lyon", "Zürich", "Köln"]),
                  rng.choice(["", "x", "x,y", "y,z,x"])]
        problem = BAD_TSV_LINES.get(number)
        if problem == "wrong field count":
            fields.append("extra")
        elif problem == "visits '12x'":
            fields[1] = "12x"
        elif problem == "empty label":
            fields[0] = ""
        lines.append("\t".join(fields))
    return "\n".join(lines) + "\n"


FRAPPE_FIELDS = 10


def frappe_line(rng: random.Random, pairs: int = FRAPPE_FIELDS) -> list[str]:
    tokens = [rng.choice(["-1", "1"])]
    for field in range(pairs):
        tokens.append(f"{field * 100 + rng.randrange(4)}:1")
    return tokens


def frappe(rng: random.Random, lines: int, bad: dict[int, str]) -> str:
    out = []
    for number in range(1, lines + 1):
        tokens = frappe_line(rng)
        problem = bad.get(number)
        if problem == "9 pairs":
            tokens = tokens[:-1]
        elif problem == "token without ':'":
            tokens[3] = tokens[3].split(":")[0]
        elif problem == "value 0.5":
            tokens[2] = tokens[2].split(":")[0] + ":0.5"
        elif problem == "label 'nan'":
            tokens[0] = "nan"
        out.append(" ".join(tokens))
    return "\n".join(out) + "\n"


def clicks_ffm(rng: random.Random) -> str:
    out = []
    for number in range(1, 26):
        tokens = [rng.choice(["0", "1"])]
        for field in range(4):
            if field == 3 and rng.random() < 0.4:
                continue  # field 3 absent: its missing value
            tokens.append(f"{field}:{field * 10 + rng.randrange(3)}:1")
        tokens.append(f"4:99:{rng.choice(['0.25', '1.5', '-0.5', '3'])}")
        problem = BAD_FFM_LINES.get(number)
        if problem == "token '0:5'":
            tokens[1] = "0:5"
        elif problem == "field 1 twice":
            tokens.insert(2, "1:12:1")
        elif problem == "no label":
            tokens = tokens[1:]
        out.append(" ".join(tokens))
    return "\n".join(out) + "\n"


def main() -> None:
    rng = random.Random(20240611)
    (HERE / "clicks.csv").write_text(clicks_csv(rng))
    (HERE / "clicks_noheader.tsv").write_text(clicks_tsv(rng), encoding="utf-8")
    (HERE / "frappe.train.libfm").write_text(frappe(rng, 40, BAD_LIBFM_LINES))
    (HERE / "frappe.validation.libfm").write_text(frappe(rng, 12, {}))
    (HERE / "frappe.test.libfm").write_text(frappe(rng, 12, {}))
    (HERE / "clicks.libffm").write_text(clicks_ffm(rng))


if __name__ == "__main__":
    main()
