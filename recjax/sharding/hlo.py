"""What a compiled step's HLO says about its collectives and arrays (tests and benchmarks/sharding.py)."""

import re

import numpy as np

COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "collective-permute", "reduce-scatter")
# The named scope of the exchange's worst-case branch (recjax/sharding/exchange.py): a step runs either it or the
# expected-capacity branch, so the bytes a step moves are those of the ops outside it unless its buckets overflow.
FALLBACK_SCOPE = "bucket_fallback"
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%\S+ = (\(.*?\)|\S+) ([\w-]+)\(")
_SHAPE = re.compile(r"\b(f32|bf16|f16|s32|u32|pred|s8|u8|f64|s64|u64)\[([\d,]*)\]")
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8,
          "u64": 8}


def _arrays(shape: str) -> list[tuple[str, int]]:
    return [(t, _BYTES[t] * int(np.prod([int(d) for d in dims.split(",") if d] or [1])))
            for t, dims in _SHAPE.findall(shape)]


def instructions(hlo_text: str) -> list[dict]:
    """Every non-parameter instruction: op, its result's arrays [(dtype, bytes)], the line."""
    out = []
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if match and match.group(2) != "parameter":
            out.append({"op": match.group(2), "arrays": _arrays(match.group(1)), "line": line.strip()})
    return out


def collectives(hlo_text: str) -> list[dict]:
    """Each collective (per device): op, dtypes, bytes (its result, summed over a tuple), `fallback` (in the
    worst-case branch a step takes only when its buckets overflow), the line (truncated)."""
    out = []
    for inst in instructions(hlo_text):
        if inst["op"].startswith(COLLECTIVES) and not inst["op"].endswith("-done"):
            out.append({"op": inst["op"].removesuffix("-start"), "dtypes": sorted({t for t, _ in inst["arrays"]}),
                        "bytes": sum(b for _, b in inst["arrays"]),
                        "largest": max((b for _, b in inst["arrays"]), default=0),
                        "fallback": f"/{FALLBACK_SCOPE}/" in inst["line"], "line": inst["line"][:200]})
    return out


def largest_array_bytes(hlo_text: str) -> int:
    """The largest array any non-parameter instruction produces."""
    return max((b for inst in instructions(hlo_text) for _, b in inst["arrays"]), default=0)
