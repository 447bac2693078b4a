"""Building blocks shared by the ranking models."""

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


def dlrm_kernel_init(key, shape, dtype=jnp.float32):
    """DLRM reference weight init: N(0, sqrt(2 / (fan_in + fan_out)))."""
    fan_in, fan_out = shape
    return jax.random.normal(key, shape, dtype) * np.sqrt(2.0 / (fan_in + fan_out))


def dlrm_bias_init(key, shape, dtype=jnp.float32):
    """DLRM reference bias init: N(0, sqrt(1 / fan_out))."""
    return jax.random.normal(key, shape, dtype) * np.sqrt(1.0 / shape[0])


class MLP(nn.Module):
    """Dense -> ReLU stack; `relu_last=False` leaves the final layer linear (logits)."""

    features: Sequence[int]
    relu_last: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i, width in enumerate(self.features):
            x = nn.Dense(width, kernel_init=dlrm_kernel_init, bias_init=dlrm_bias_init, name=f"dense_{i}")(x)
            if i < len(self.features) - 1 or self.relu_last:
                x = nn.relu(x)
        return x
