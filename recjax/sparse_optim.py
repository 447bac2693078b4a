"""Sparse optimizers for physical row tables.

A step touches only the rows a batch looked up. The engine deduplicates ids and differentiates with respect
to the distinct rows, so each row arrives here once with its exactly summed gradient (FBGEMM's EXACT_*
semantics); `sparse_apply` gathers those rows' optimizer state, applies a row-wise rule and scatters rows and
state back into the (donated) arrays. Cost is O(ids in the batch), never O(rows in the table).

Each optimizer is a pure row-wise rule `update_rows(rows, state_rows, grads, lr, step)`, easy to check against
numpy; a fused kernel can replace the gather/scatter plumbing without touching the rules.

Every optimizer takes `weight_decay` (>= 0): a lazy, coupled L2 term. `sparse_apply` adds weight_decay * w to each
touched row's summed gradient, once per step however often the row occurs, before the rule runs:
    g' = g + weight_decay * w        (the gradient of weight_decay / 2 * ||w||^2 for the rows in the batch)
This is FBGEMM's `WeightDecayMode.L2` (fbgemm_gpu/codegen/genscript/optimizers.py: `gx += weight_decay * weight`
before `g_local_sum_square`), so with Adagrad and row-wise Adagrad the decayed gradient also feeds the
accumulator, and with lazy Adam both moments; it is not decoupled (AdamW-style) decay. Rows not in the batch
do not decay: an id unseen for many steps keeps its value, unlike a dense L2 on the whole table.
"""

import abc
import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import ml_collections

from pallas_kernels import SegmentGrads, fused_row_update

State = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class SparseOptimizer(abc.ABC):
    learning_rate: float
    # Lazy coupled L2 on the touched rows: g' = g + weight_decay * w (see the module docstring). Keyword-only, so
    # the subclasses' positional fields keep their order.
    weight_decay: float = dataclasses.field(default=0.0, kw_only=True)
    name: ClassVar[str]
    # True when the rule is rows + f(grads) with f linear and no state (plain SGD): the update of a row is then the
    # sum of its occurrences' updates, so it can be scattered with duplicates, without deduplicating ids first.
    linear_in_grads: ClassVar[bool] = False
    # State fields that are never negative (sums / averages of squared gradients): checkpoint deltas may store them
    # in an unsigned code (recjax/quantize.py `quantize_state_rows`).
    nonnegative_state: ClassVar[frozenset[str]] = frozenset()

    def __post_init__(self):
        if not self.weight_decay >= 0:
            raise ValueError(f"sparse optimizer '{self.name}': weight_decay must be >= 0, got {self.weight_decay}; "
                             f"set optimizer.sparse.weight_decay to e.g. 1e-5 (0 turns it off)")

    @abc.abstractmethod
    def state_shapes(self, rows: int, dim: int) -> dict[str, tuple[int, ...]]:
        """Shapes of the per-row optimizer state arrays for a [rows, dim] table."""

    def init(self, rows: int, dim: int) -> State:
        return {k: jnp.full(s, self.initial_state_value(k), jnp.float32)
                for k, s in self.state_shapes(rows, dim).items()}

    def initial_state_value(self, key: str) -> float:
        del key
        return 0.0

    def state_bytes(self, rows: int, dim: int) -> int:
        total = 0
        for shape in self.state_shapes(rows, dim).values():
            n = 1
            for s in shape:
                n *= s
            total += 4 * n
        return total

    @property
    def sums_duplicates(self) -> bool:
        """Whether scattering each occurrence's update (duplicates included) is exactly this optimizer's step.

        Weight decay breaks it: the decay term is applied once per distinct row, not once per occurrence.
        """
        return self.linear_in_grads and not self.weight_decay

    @abc.abstractmethod
    def update_rows(self, rows: jax.Array, state: State, grads: jax.Array, lr: jax.Array,
                    step: jax.Array) -> tuple[jax.Array, State]:
        """New values of distinct rows f32[U, D] and their state, given summed gradients f32[U, D].

        `step` is the 1-based count of optimizer steps taken so far including this one. `grads` already include
        the weight-decay term (`sparse_apply` adds it), so a rule never reads `weight_decay`.
        """


@dataclasses.dataclass(frozen=True)
class SGD(SparseOptimizer):
    name: ClassVar[str] = "sgd"
    linear_in_grads: ClassVar[bool] = True

    def state_shapes(self, rows, dim):
        return {}

    def update_rows(self, rows, state, grads, lr, step):
        return rows - lr * grads, state


@dataclasses.dataclass(frozen=True)
class Adagrad(SparseOptimizer):
    """Element-wise Adagrad (Duchi et al. 2011): acc += g^2; w -= lr * g / (sqrt(acc) + eps)."""

    eps: float = 1e-8
    initial_accumulator_value: float = 0.0
    name: ClassVar[str] = "adagrad"
    nonnegative_state: ClassVar[frozenset[str]] = frozenset({"accumulator"})

    def state_shapes(self, rows, dim):
        return {"accumulator": (rows, dim)}

    def initial_state_value(self, key):
        return self.initial_accumulator_value

    def update_rows(self, rows, state, grads, lr, step):
        acc = state["accumulator"] + grads * grads
        return rows - lr * grads / (jnp.sqrt(acc) + self.eps), {"accumulator": acc}


@dataclasses.dataclass(frozen=True)
class RowwiseAdagrad(SparseOptimizer):
    """FBGEMM's default: one accumulator per row, fed the mean squared gradient over the row."""

    eps: float = 1e-8
    initial_accumulator_value: float = 0.0
    name: ClassVar[str] = "rowwise_adagrad"
    nonnegative_state: ClassVar[frozenset[str]] = frozenset({"accumulator"})

    def state_shapes(self, rows, dim):
        return {"accumulator": (rows,)}

    def initial_state_value(self, key):
        return self.initial_accumulator_value

    def update_rows(self, rows, state, grads, lr, step):
        acc = state["accumulator"] + jnp.mean(grads * grads, axis=-1)
        return rows - lr * grads / (jnp.sqrt(acc)[:, None] + self.eps), {"accumulator": acc}


@dataclasses.dataclass(frozen=True)
class LazyAdam(SparseOptimizer):
    """Adam whose moments move only for rows in the batch; bias correction uses the global step.

    form="tf" (default) is TF's LazyAdam / Keras Adam, epsilon "hat" outside the bias correction:
        lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t);  w -= lr_t * m / (sqrt(v) + eps),  eps = 1e-7 (TF's default)
    form="adam" is Kingma & Ba (2015), Algorithm 1, epsilon added to the bias-corrected second moment:
        w -= lr * m_hat / (sqrt(v_hat) + eps)
    They differ when sqrt(v) is not much larger than eps: with eps = 1e-3 and one gradient of 1e-3 at step 1, lr 0.1
    moves the row by -0.0031 (tf) and -0.050 (adam).
    """

    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-7
    form: str = "tf"
    name: ClassVar[str] = "lazy_adam"
    nonnegative_state: ClassVar[frozenset[str]] = frozenset({"v"})

    def __post_init__(self):
        super().__post_init__()
        if self.form not in ("tf", "adam"):
            raise ValueError(f"lazy_adam form must be 'tf' or 'adam', got {self.form!r}; set "
                             "optimizer.sparse.form")

    def state_shapes(self, rows, dim):
        return {"m": (rows, dim), "v": (rows, dim)}

    def update_rows(self, rows, state, grads, lr, step):
        m = self.b1 * state["m"] + (1 - self.b1) * grads
        v = self.b2 * state["v"] + (1 - self.b2) * grads * grads
        t = step.astype(jnp.float32)
        if self.form == "tf":
            lr_t = lr * jnp.sqrt(1 - self.b2**t) / (1 - self.b1**t)
            return rows - lr_t * m / (jnp.sqrt(v) + self.eps), {"m": m, "v": v}
        m_hat = m / (1 - self.b1**t)
        v_hat = v / (1 - self.b2**t)
        return rows - lr * m_hat / (jnp.sqrt(v_hat) + self.eps), {"m": m, "v": v}


SPARSE_OPTIMIZERS: dict[str, type[SparseOptimizer]] = {
    cls.name: cls for cls in (SGD, Adagrad, RowwiseAdagrad, LazyAdam)
}


def make_sparse_optimizer(config: ml_collections.ConfigDict) -> SparseOptimizer:
    """From `config.optimizer.sparse`: name, learning_rate and the optimizer's own knobs."""
    kwargs = dict(config)
    name = kwargs.pop("name")
    if name not in SPARSE_OPTIMIZERS:
        raise ValueError(f"unknown sparse optimizer '{name}'; known: {sorted(SPARSE_OPTIMIZERS)}")
    cls = SPARSE_OPTIMIZERS[name]
    allowed = {f.name for f in dataclasses.fields(cls)}
    unknown = set(kwargs) - allowed
    if unknown:
        raise ValueError(f"sparse optimizer '{name}' has no options {sorted(unknown)}; it takes {sorted(allowed)}")
    return cls(**kwargs)


def sparse_apply(optimizer: SparseOptimizer, table: jax.Array, state: State, unique_rows: jax.Array,
                 current: jax.Array | None, grads: jax.Array | SegmentGrads, lr: jax.Array, step: jax.Array, *,
                 kernel: str = "auto", interpret: bool | None = None) -> tuple[jax.Array, State]:
    """Apply one optimizer step to distinct rows of `table` and their state, in place.

    Args:
      table: f32[R, D] (donate it: the update then writes in place).
      state: per-row optimizer state, leading dim R.
      unique_rows: i32[U] distinct row ids; ids >= R are padding and ignored.
      current: f32[U, D] the rows' current values (the forward pass gathered them already), or None when the
        forward pooled straight from the table: the update then reads the rows itself.
      grads: f32[U, D] summed gradient of each distinct row (of the loss, without weight decay), or the
        `SegmentGrads` that sum it from the occurrences' gradients (the fused backward + update).
      kernel: "auto" (the Pallas kernel on TPU / GPU, XLA on CPU), "xla", "pallas", "pallas_tpu" or "pallas_gpu"
        (on a CPU: the kernel in Pallas's interpreter, for tests) -- pallas_kernels/dispatch.py.
      interpret: run the Pallas kernel interpreted; None: on a CPU (the caller's collection says, see
        `EmbeddingCollection.interpret`).
    """
    rule = row_rule(optimizer)
    if interpret is None:  # kernels run interpreted on a CPU
        interpret = kernel.startswith("pallas") and jax.default_backend() == "cpu"
    return fused_row_update(table, state, unique_rows, current, grads, rule, lr, step, impl=kernel,
                            interpret=interpret)


def row_rule(optimizer: SparseOptimizer):
    """`rule(rows, state_rows, grads, lr, step) -> (rows, state_rows)`: the optimizer's row rule with its weight decay
    folded into the gradient, as the fused update applies it to a block of distinct rows."""
    decay = optimizer.weight_decay

    def rule(rows, state_rows, grads, lr, step):
        # Coupled L2 (FBGEMM WeightDecayMode.L2): each distinct row once, before the rule (so it reaches the
        # accumulators too).
        return optimizer.update_rows(rows, state_rows, grads + decay * rows if decay else grads, lr, step)

    return rule


def scatter_apply(optimizer: SparseOptimizer, table: jax.Array, ids: jax.Array, grads: jax.Array, lr: jax.Array,
                  step: jax.Array) -> jax.Array:
    """One optimizer step as a scatter-add of every occurrence's update, duplicates included, in place.

    Exact only for rules that sum over duplicates (`optimizer.sums_duplicates`: plain SGD): it skips the dedup
    `sparse_apply` needs. The rule is the optimizer's own, applied to zero rows (its update is then the delta).

    Args:
      table: f32[R, D] (donate it).
      ids: int [N] row ids, duplicates allowed; ids >= R (the padding sentinel) are dropped.
      grads: f32[N, D] the gradient of each occurrence.
    """
    return table.at[ids].add(scatter_delta(optimizer, grads, lr, step).astype(table.dtype), mode="drop")


def scatter_delta(optimizer: SparseOptimizer, grads: jax.Array, lr: jax.Array, step: jax.Array) -> jax.Array:
    """Each occurrence's row update f32[N, D] from its gradient, for a rule that sums over duplicates (`scatter_apply`
    adds them into the table; host memory adds them on the host): the optimizer's rule on a zero row."""
    if not optimizer.sums_duplicates:
        raise ValueError(f"sparse optimizer '{optimizer.name}' (weight_decay={optimizer.weight_decay}) needs "
                         "distinct rows; use sparse_apply")
    delta, _ = optimizer.update_rows(jnp.zeros((), grads.dtype), {}, grads, lr, step)
    return delta
