"""Which tier -- which storage -- each physical table lives in, from the `tiering` section.

A table's tier is, first match wins: its entry in `tiering.tables` ("C3=disk,C4/q=disk,C4/r=memory"; a feature's name
covers all its physical tables), disk if its rows + optimizer state exceed `tiering.disk_over_bytes` (> 0), host if
they exceed `tiering.host_over_bytes` (> 0), else `tiering.default`. The tier names are the storages'
(`recjax.placement.STORAGES`); a group takes the storage of its tables' last tier in that registry
(`recjax.placement.build`).
"""

import dataclasses
from collections.abc import Sequence

from recjax.errors import ConfigError
from recjax.sections import TieringSection


@dataclasses.dataclass(frozen=True)
class TableBytes:
    """What the rules need to know of one physical table."""

    name: str
    feature: str
    bytes: int  # rows + optimizer state


def table_bytes(collection, optimizer) -> list[TableBytes]:
    """Each physical table's rows + optimizer state, in bytes, for the tier rules."""
    return [TableBytes(p.table.name, p.feature, 4 * p.table.rows * p.table.dim
                       + (optimizer.state_bytes(p.table.rows, p.table.dim) if optimizer else 0))
            for p in collection.physical_tables()]


def parse_table_tiers(text: str, tables: Sequence[TableBytes], tiers: Sequence[str]) -> dict[str, str]:
    """`tiering.tables` = "C3=disk,C4/q=disk" -> {physical table: tier}; a feature's name covers its tables."""
    if not isinstance(text, str):
        raise ConfigError("tiering.tables", f"must be a string such as 'C3=disk,C4/q=disk', got {text!r}")
    names = {t.name for t in tables}
    features = {t.feature for t in tables}
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, tier = (x.strip() for x in part.partition("="))
        if not eq or tier not in tiers:
            raise ConfigError("tiering.tables", f"cannot read {part!r}: write table=tier with a tier in {list(tiers)}, "
                                                "e.g. C3=disk")
        if name not in names and name not in features:
            raise ConfigError("tiering.tables", f"unknown table {name!r}; the tables are {sorted(features)} (and "
                                                f"their physical tables {sorted(names - features)})")
        for target in [name] if name in names else [t.name for t in tables if t.feature == name]:
            out[target] = tier
    return out


def resolve_tiers(tables: Sequence[TableBytes], tiering: TieringSection, tiers: Sequence[str]) -> dict[str, str]:
    """{physical table: tier} for `tables` under the `tiering` section; `tiers` the names a tier may have."""
    overrides = parse_table_tiers(tiering.tables, tables, tiers)
    rules = {"disk": tiering.disk_over_bytes, "host": tiering.host_over_bytes}  # the section's byte rules, in order
    out = {}
    for t in tables:
        if t.name in overrides:
            out[t.name] = overrides[t.name]
            continue
        out[t.name] = next((tier for tier, limit in rules.items() if limit and t.bytes > limit), tiering.default)
    return out
