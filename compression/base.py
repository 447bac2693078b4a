"""The physical-table interface every embedding method implements.

A *logical table* (`TableSpec`) is what a researcher configures: "feature C3, 10M ids, dim 64, method=full".
A method compiles it into
  1. `physical_tables()`: plain row arrays f32[rows, dim] with static shapes (memory accounting, sharding,
     checkpoints and sparse optimizers only ever see these);
  2. `route(ids)`: integer math from logical ids i32[...] to one row-id array per physical table (runs in jit);
  3. `combine_module()`: a Flax module mapping the gathered rows of each physical table to the feature's
     embedding f32[..., dim] (the "dense glue": MD projections, TT cores, ...).

Route outputs are one per physical table unless `read_tables()` says otherwise: FIITED reads its one chunk pool
once per chunk position. A method whose routing changes during training (FIITED's indirection) keeps it in
`init_aux()` arrays: the trainer carries them in its state and `route` receives them as keyword arguments.

If `pools_before_combine` is True, combine is linear per row, so the engine may pool each physical table's
rows over the bag first (a gather-reduce) and combine once per example; otherwise it gathers un-pooled rows,
combines per id and pools afterwards.
"""

import abc
import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import flax.linen as nn
import jax


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """A logical embedding table for one sparse feature."""

    name: str
    vocab_size: int  # number of distinct logical ids: valid ids are [0, vocab_size)
    dim: int  # embedding width the model receives
    method: str = "full"  # key into compression.METHODS
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # method-specific knobs

    def __post_init__(self):
        if self.vocab_size < 1:
            raise ValueError(f"table '{self.name}': vocab_size must be >= 1, got {self.vocab_size}")
        if self.dim < 1:
            raise ValueError(f"table '{self.name}': dim must be >= 1, got {self.dim}")


@dataclasses.dataclass(frozen=True)
class PhysicalTable:
    """A plain row array f32[rows, dim] owned by one logical table."""

    name: str  # "<logical>" or "<logical>/<part>"
    rows: int
    dim: int
    init_scale: float  # rows are initialised U(init_center - init_scale, init_center + init_scale)
    init_center: float = 0.0  # 0 for every method's default; the reference's all-positive QR init shifts it
    # Multiplies the sparse optimizer's weight_decay on these rows: 1 where a row is an id's embedding (or a part of
    # it, as MD blocks and FIITED chunks); the factor tables of QR / TT-Rec take their method's `row_decay` option.
    decay_scale: float = 1.0

    @property
    def params(self) -> int:
        return self.rows * self.dim

    def nbytes(self, itemsize: int = 4) -> int:
        return self.params * itemsize


def dlrm_init_scale(rows: int) -> float:
    """DLRM reference initialisation bound: U(-sqrt(1/n), sqrt(1/n)) for an n-row table."""
    return math.sqrt(1.0 / rows)


class EmbeddingMethod(abc.ABC):
    """One logical table compiled to physical tables, a route and a combine."""

    # Combine is linear in each physical row, so bags may be pooled before combining.
    pools_before_combine: ClassVar[bool] = True
    # Ids outside [0, vocab_size) are meaningful (e.g. hashing); otherwise the host rejects them.
    accepts_any_id: ClassVar[bool] = False
    # `update_aux` needs d loss / d the feature's embedding (FIITED's gradient utility).
    wants_embedding_grads: bool = False

    def __init__(self, spec: TableSpec):
        self.spec = spec

    @abc.abstractmethod
    def physical_tables(self) -> tuple[PhysicalTable, ...]:
        """Static shapes of the row arrays this method owns."""

    @abc.abstractmethod
    def route(self, ids: jax.Array, **aux: jax.Array) -> tuple[jax.Array, ...]:
        """Logical ids i32[...] -> one local row-id array i32[...] per read (`read_tables`: by default one per
        physical table). `aux` are the method's `init_aux` arrays as they stand (none for a static method).

        A negative local row means the id has no row in that table: it reads zeros and is never updated.
        """

    def read_tables(self) -> tuple[int, ...]:
        """For each array `route` returns, the index of the physical table it reads (default: one read each)."""
        return tuple(range(len(self.physical_tables())))

    def init_aux(self) -> dict[str, jax.Array]:
        """Arrays the method keeps beside its physical tables and changes during training without gradients (FIITED's
        indirection and chunk utility); {} for the static methods."""
        return {}

    @abc.abstractmethod
    def combine_module(self, name: str) -> nn.Module:
        """Flax module: tuple of f32[..., d_t] (one per physical table) -> f32[..., spec.dim]."""

    def update_aux(self, aux: dict[str, jax.Array], ids: jax.Array, weights: jax.Array, g_emb: jax.Array,
                   step: jax.Array) -> dict[str, jax.Array]:
        """The `init_aux` arrays after a train step (in the jitted step): ids i32[B, L] and their pooling weights
        f32[B, L] (0 = padding), g_emb f32[B, D] = d loss / d this feature's embedding when
        `wants_embedding_grads`, else None; `step` is the step just taken."""
        del ids, weights, g_emb, step
        return aux

    def aux_bytes(self) -> tuple[int, int]:
        """Bytes of the `init_aux` arrays: (those the model needs to serve, those only training needs)."""
        return 0, 0

    def glue_params(self) -> int:
        """Number of dense glue parameters (0 for methods without any)."""
        return 0


# Default of the factor methods' `row_decay` option (QR family, path QR, TT-Rec): their rows are factors shared by
# many ids, not any id's embedding. The row L2 tuned for full tables (weight_decay * w on each touched row, every
# step it is touched) reaches a shared row every step while the gradient it gets per id is diluted -- and for a
# product of factors (QR mult, TT) the L2 gradient is first order in each factor where the loss's is second, so
# the factors decay to zero: on ML-100K with optimizer.sparse.weight_decay 3e-3 QR mult and TT-Rec trained to the
# label prior at every ratio, and with their rows undecayed they learn (benchmarks/RESULTS.md, "row L2 on factor
# tables").
# Shi et al. and Yin et al. train without any weight decay.
FACTOR_ROW_DECAY = 0.0


def row_decay_option(spec: TableSpec, value: Any) -> float:
    """The validated `row_decay` option: the multiple of optimizer.sparse.weight_decay a method's rows take."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"table '{spec.name}': option row_decay must be a number >= 0 (the multiple of "
                         f"optimizer.sparse.weight_decay the method's rows take), got {value!r}")
    return float(value)


# Keys the collection-level planner (compression/plan.py) consumes; they never reach a method.
PLAN_OPTIONS = ("threshold",)


def method_options(spec: TableSpec, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """`spec.options` over `defaults`; an option the method does not take is a ValueError naming the table.

    Every method reads its knobs through this, so a misspelt key (`colisions=4`) fails loudly instead of
    silently falling back to a default.
    """
    options = dict(spec.options)
    planned = sorted(set(options) & set(PLAN_OPTIONS))
    if planned:
        raise ValueError(
            f"table '{spec.name}': option(s) {planned} are applied by compression.plan.plan_tables (a table at or "
            f"under its threshold stays full); build table specs with plan_tables instead of passing them here")
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ValueError(f"table '{spec.name}': method '{spec.method}' has no option(s) {unknown}; "
                         f"it takes {sorted(defaults)}")
    return {**defaults, **options}
