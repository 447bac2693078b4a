"""Matrix factorisation on the same interface as DLRM: (dense f32[B, 0], embeddings f32[B, 2, D]) -> outputs f32[B].

The classic collaborative-filtering model (Koren, Bell & Volinsky 2009, "Matrix Factorization Techniques for
Recommender Systems", eq. 1, plus their global average mu of eq. 3): a user's and an item's D-dimensional factors
meet in an inner product,

    output = mu + <p_user, q_item>

with mu a learned scalar (dense param, zero init). The factors are the two sparse features' embedding rows, so they
train with the sparse optimizer and take any compression method -- mixed-dimension blocks (Ginart et al. 2019, whose
collaborative-filtering experiments are MF on MovieLens ratings with a squared-error loss) project each block's rows
to D before the product. For ratings (a "regression" dataset: recjax/task.py OBJECTIVES) the output is the
predicted rating; for clicks it is a logit (logistic MF). Per-id biases are not part of this model: every parameter
is in the factors, as in the MD paper's parameter counts.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp


class MatrixFactorization(nn.Module):
    """mu + <e_0, e_1> over exactly two sparse features (user, item) and no dense features."""

    @nn.compact
    def __call__(self, dense: jax.Array, embeddings: jax.Array, train: bool = False) -> jax.Array:
        """dense: f32[B, 0], embeddings: f32[B, 2, D] -> f32[B]; `train` is ignored (no dropout)."""
        del train
        assert dense.ndim == 2 and embeddings.ndim == 3 and dense.shape[0] == embeddings.shape[0], (
            dense.shape, embeddings.shape)
        if embeddings.shape[1] != 2:
            raise ValueError(f"mf scores the inner product of two sparse features (user, item), but the data has "
                             f"{embeddings.shape[1]}; use MovieLens with data.features='user_item', or fm for more "
                             "fields")
        if dense.shape[1]:
            raise ValueError(f"mf uses the two ids only, but the data has {dense.shape[1]} dense features; drop them "
                             "(MovieLens: data.features='user_item') or use fm / dlrm")
        mu = self.param("mu", nn.initializers.zeros, (), jnp.float32)
        return mu + jnp.sum(embeddings[:, 0] * embeddings[:, 1], axis=-1)
