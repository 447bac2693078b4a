"""What is trained: the `Task` (embedding collection, glue, model, both optimizers, objective) built from a config.

`build_task(config, spec)` plans the logical tables (`compression.plan.plan_tables`), compiles them to stacked physical
tables (`EmbeddingCollection`), and makes the model and the dense / sparse optimizers with their schedules. The
objective -- the loss the step minimises, what a prediction is, the metrics an evaluation reports -- is the dataset's
(`spec.target`, `OBJECTIVES`): clicks train a logit with log loss, ratings a value with squared error.
"""

import dataclasses
from collections.abc import Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax

from compression import TableSpec
from compression.plan import load_id_counts, plan_tables
from recjax import metrics
from recjax.embedding import EmbeddingCollection, EmbeddingGlue, resolve_dedup
from recjax.errors import ConfigError
from recjax.kernel_choice import choose_kernel
from recjax.models import embedding_dim, make_model
from recjax.sections import EmbeddingSection, OptimizerSection, read_section, read_sections
from recjax.sparse_optim import SPARSE_OPTIMIZERS, SparseOptimizer, make_sparse_optimizer
from recjax.specs import DatasetSpec
from recjax.validation import choice, config_errors, integer, known_keys, number

DECAYS = ("none", "cosine")
# The dense optimizers (optax), each the transform that scales the gradient before the learning rate.
DENSE_OPTIMIZERS = {"sgd": optax.identity, "adam": optax.scale_by_adam,
                    "adagrad": lambda: optax.scale_by_rss(initial_accumulator_value=0.0, eps=1e-8)}


@dataclasses.dataclass(frozen=True)
class Objective:
    """What the model's output f32[B] means: how a step is trained on it and how an evaluation scores it."""

    name: str
    loss: Callable[[jax.Array, jax.Array], jax.Array]  # (outputs f32[B], labels f32[B]) -> per-example loss f32[B]
    predict: Callable[[jax.Array], jax.Array]  # outputs f32[B] -> predictions f32[B] (probabilities, ratings)
    evaluate: Callable[..., dict]  # (labels, predictions) -> {metric: value, plus `extras`}, on the host
    metrics: tuple[str, ...]  # what `evaluate` reports, in order (metrics.csv columns, summary.json's headline)
    tracked: tuple[str, ...]  # validation metrics whose best step is tracked; `train.select_on` is one of them
    extras: tuple[str, ...]  # `evaluate`'s other keys: the eval set's size and its mean label


def _squared_error(outputs: jax.Array, labels: jax.Array) -> jax.Array:
    return jnp.square(outputs - labels)


# One entry per DatasetSpec target (recjax/specs.py TARGETS).
OBJECTIVES = {
    "binary": Objective("binary", optax.sigmoid_binary_cross_entropy, jax.nn.sigmoid, metrics.binary_metrics,
                        metrics.METRICS, ("auc", "logloss"), ("eval_examples", "eval_ctr")),
    "regression": Objective("regression", _squared_error, lambda outputs: outputs, metrics.regression_metrics,
                            metrics.REGRESSION_METRICS, ("mse",), ("eval_examples", "eval_mean")),
}


def objective_for(spec: DatasetSpec, select_on: str | None = None) -> Objective:
    """The dataset's objective; a ConfigError when `select_on` (train.select_on) is not one of its tracked metrics."""
    objective = OBJECTIVES[spec.target]
    if select_on is not None and select_on not in objective.tracked:
        raise ConfigError("train.select_on", f"{select_on!r} is not a metric of this dataset's {spec.target} labels "
                                             f"(it reports {', '.join(objective.metrics)}); set "
                                             f"--config.train.select_on={objective.tracked[0]}")
    return objective


@dataclasses.dataclass(frozen=True)
class Task:
    """Everything static a step needs: the embedding collection, the model, both optimizers and the objective."""

    spec: DatasetSpec
    collection: EmbeddingCollection
    glue: nn.Module
    model: nn.Module
    dense_tx: optax.GradientTransformation
    sparse_optimizer: SparseOptimizer
    sparse_lr: optax.Schedule
    objective: Objective = OBJECTIVES["binary"]



def table_specs(spec: DatasetSpec, config: ml_collections.ConfigDict, dataset=None,
                train_examples: int | None = None) -> list[TableSpec]:
    """One logical table per sparse feature, planned from `config.embedding` by `compression.plan.plan_tables`
    (default method and options, per-table overrides in `tables`, size thresholds, mixed dims).

    `config.embedding.id_counts` feeds per-id counts to md_blocks tables: "dataset" asks `dataset` for its
    expected counts over the run's `train_examples`; any other non-empty value is the path of an .npz with one
    array per feature.
    """
    embedding = read_section(config, "embedding", EmbeddingSection)
    counts = None
    if embedding.id_counts == "dataset":
        if dataset is None or not hasattr(dataset, "id_counts"):
            raise ConfigError("embedding.id_counts", f"'dataset', but dataset '{config.data.name}' has no expected id "
                                                     "counts; pass an .npz of per-feature counts instead")
        counts = dataset.id_counts(train_examples)
    elif embedding.id_counts:
        counts = load_id_counts(embedding.id_counts)
    return plan_tables([f.name for f in spec.features], [f.vocab_size for f in spec.features], embedding_dim(config),
                       {"method": embedding.method, "options": embedding.options, "tables": embedding.tables},
                       id_counts=counts)


def check_optimizer(config: Mapping) -> None:
    known_keys(config, "optimizer", {"dense", "sparse", "warmup_steps", "decay"})
    known_keys(config, "optimizer.dense", {"name", "learning_rate", "weight_decay"})
    choice(config, "optimizer.dense.name", list(DENSE_OPTIMIZERS))
    number(config, "optimizer.dense.learning_rate", above=0)
    number(config, "optimizer.dense.weight_decay", at_least=0)
    name = choice(config, "optimizer.sparse.name", sorted(SPARSE_OPTIMIZERS))
    number(config, "optimizer.sparse.learning_rate", above=0)
    number(config, "optimizer.sparse.weight_decay", at_least=0)
    known_keys(config, "optimizer.sparse", {"name"} | {f.name for f in dataclasses.fields(SPARSE_OPTIMIZERS[name])})
    integer(config, "optimizer.warmup_steps", 0)
    choice(config, "optimizer.decay", DECAYS)


def schedule(base_lr: float, optimizer: OptimizerSection, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 over `warmup_steps`, then constant (or cosine to 0 at `total_steps`)."""
    warmup = optimizer.warmup_steps
    if optimizer.decay == "none":
        if warmup == 0:
            return optax.constant_schedule(base_lr)
        return optax.linear_schedule(0.0, base_lr, warmup)
    if optimizer.decay == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, base_lr, max(warmup, 1), total_steps)
    raise ConfigError("optimizer.decay", f"unknown decay '{optimizer.decay}'; use one of {list(DECAYS)}")


def _is_weight_matrix(params):
    """Decay mask: kernels and other >= 2-d weights decay; biases and LayerNorm scales (1-d) do not."""
    return jax.tree_util.tree_map(lambda x: jnp.ndim(x) >= 2, params)


def make_dense_optimizer(optimizer: OptimizerSection, total_steps: int) -> optax.GradientTransformation:
    """The dense optimizer, with decoupled weight decay (Loshchilov & Hutter 2019: AdamW; for SGD it equals L2)
    scaled by the learning rate schedule like optax.adamw."""
    dense = optimizer.dense
    if dense.name not in DENSE_OPTIMIZERS:
        raise ConfigError("optimizer.dense.name", f"unknown dense optimizer '{dense.name}'; use one of "
                                                  f"{sorted(DENSE_OPTIMIZERS)}")
    parts = [DENSE_OPTIMIZERS[dense.name]()]
    if dense.weight_decay:
        parts.append(optax.add_decayed_weights(dense.weight_decay, mask=_is_weight_matrix))
    parts.append(optax.scale_by_learning_rate(schedule(dense.learning_rate, optimizer, total_steps)))
    return optax.chain(*parts)


def build_task(config: ml_collections.ConfigDict, spec: DatasetSpec, dataset=None, total_steps: int = 1) -> Task:
    """`dataset` is only consulted for per-id counts (config.embedding.id_counts = "dataset"); `total_steps` sets
    the cosine decay's end and the examples those counts cover."""
    sections = read_sections(config)
    optimizer, embedding = sections.optimizer, sections.embedding
    objective = objective_for(spec, sections.train.select_on)
    with config_errors("optimizer.sparse"):
        sparse_optimizer = make_sparse_optimizer(optimizer.sparse)
    with config_errors("embedding"):
        examples = total_steps * sections.train.batch_size
        tables = table_specs(spec, config, dataset, examples)
        # embedding.kernel="auto" is chosen for this device kind and step shape (recjax/kernel_choice.py): from the
        # XLA collection's structure, before the run's collection is built with the chosen kernel and pool_from.
        probe = EmbeddingCollection(spec, tables, embedding.pooling, embedding.bounds_check, "xla")
        chosen = choose_kernel(embedding, probe, sparse_optimizer, sections.train.batch_size)
        kernel = chosen["kernel"]
        collection = EmbeddingCollection(spec, tables, embedding.pooling, embedding.bounds_check, kernel,
                                         resolve_dedup(embedding.dedup, kernel, sparse_optimizer,
                                                       multi_hot=any(f.bag_size > 1 for f in spec.features)),
                                         chosen["pool_from"], chosen)
        collection.kernel_choice.update(pool_from=collection.pool_from, dedup=collection.dedup)
    with config_errors("model"):
        model = make_model(config.model, embedding_dim(config))
    return Task(
        spec=spec,
        collection=collection,
        glue=EmbeddingGlue(collection),
        model=model,
        dense_tx=make_dense_optimizer(optimizer, total_steps),
        sparse_optimizer=sparse_optimizer,
        sparse_lr=schedule(float(optimizer.sparse["learning_rate"]), optimizer, total_steps),
        objective=objective,
    )
