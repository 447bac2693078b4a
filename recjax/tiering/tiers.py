"""Which storage tier each physical table lives in, from `config.tiering`.

    memory  the table is a device array (today's engine)
    host    on a GPU / TPU: rows in host RAM behind a device-memory cache; on a CPU host RAM *is* device memory, so
            the same as memory
    disk    rows and their optimizer-state rows in a file on local disk behind an in-RAM cache

A table's tier is, first match wins: its entry in `tiering.tables` ("C3=disk,C4/q=disk,C4/r=memory"; a feature's name
covers all its physical tables), disk if its rows + optimizer state exceed `tiering.disk_over_bytes` (> 0), host if
they exceed `tiering.host_over_bytes` (> 0), else `tiering.default`.
"""

import dataclasses
from collections.abc import Mapping, Sequence

from recjax.errors import ConfigError

TIERS = ("memory", "host", "disk")
CACHED_TIERS = ("host", "disk")  # tiers whose rows live behind the cache


@dataclasses.dataclass(frozen=True)
class TableBytes:
    """What the rules need to know of one physical table."""

    name: str
    feature: str
    bytes: int  # rows + optimizer state


def parse_table_tiers(text: str, tables: Sequence[TableBytes]) -> dict[str, str]:
    """`tiering.tables` = "C3=disk,C4/q=disk" -> {physical table: tier}; a feature's name covers its tables."""
    if not isinstance(text, str):
        raise ConfigError("tiering.tables", f"must be a string such as 'C3=disk,C4/q=disk', got {text!r}")
    names = {t.name for t in tables}
    features = {t.feature for t in tables}
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, tier = (x.strip() for x in part.partition("="))
        if not eq or tier not in TIERS:
            raise ConfigError("tiering.tables", f"cannot read {part!r}: write table=tier with a tier in {list(TIERS)}, "
                                                "e.g. C3=disk")
        if name not in names and name not in features:
            raise ConfigError("tiering.tables", f"unknown table {name!r}; the tables are {sorted(features)} (and "
                                                f"their physical tables {sorted(names - features)})")
        for target in [name] if name in names else [t.name for t in tables if t.feature == name]:
            out[target] = tier
    return out


def resolve_tiers(tables: Sequence[TableBytes], tiering: Mapping, platform: str) -> dict[str, str]:
    """{physical table: tier} for `tables` under the `tiering` section, on `platform` ("cpu", "gpu", "tpu"): host
    becomes memory on a CPU, where host RAM is the device's memory."""
    overrides = parse_table_tiers(tiering.get("tables", ""), tables)
    disk_over, host_over = int(tiering.get("disk_over_bytes", 0)), int(tiering.get("host_over_bytes", 0))
    tiers = {}
    for t in tables:
        if t.name in overrides:
            tier = overrides[t.name]
        elif disk_over and t.bytes > disk_over:
            tier = "disk"
        elif host_over and t.bytes > host_over:
            tier = "host"
        else:
            tier = tiering.get("default", "memory")
        tiers[t.name] = "memory" if tier == "host" and platform == "cpu" else tier
    return tiers

