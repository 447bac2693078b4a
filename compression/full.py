"""The uncompressed baseline: one row per logical id."""

import flax.linen as nn
import jax

from compression.base import EmbeddingMethod, PhysicalTable, dlrm_init_scale


class FirstRows(nn.Module):
    """Combine for single-table methods: the embedding is the gathered row itself."""

    @nn.compact
    def __call__(self, rows: tuple[jax.Array, ...]) -> jax.Array:
        (only,) = rows
        return only


class FullEmbedding(EmbeddingMethod):
    """f32[vocab_size, dim]; route is the identity."""

    def physical_tables(self) -> tuple[PhysicalTable, ...]:
        spec = self.spec
        return (PhysicalTable(spec.name, spec.vocab_size, spec.dim, dlrm_init_scale(spec.vocab_size)),)

    def route(self, ids: jax.Array) -> tuple[jax.Array, ...]:
        return (ids,)

    def combine_module(self, name: str) -> nn.Module:
        return FirstRows(name=name)
