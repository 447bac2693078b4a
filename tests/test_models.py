"""DLRM interactions and model shapes against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recjax.models.dlrm import DLRM, cat_interaction, dot_interaction


@pytest.mark.parametrize("self_interaction", [False, True])
def test_dot_interaction_matches_numpy_loops(self_interaction):
    rng = np.random.default_rng(0)
    b, f, d = 3, 4, 5
    x = rng.normal(size=(b, d)).astype(np.float32)
    ly = rng.normal(size=(b, f, d)).astype(np.float32)
    out = np.asarray(dot_interaction(jnp.asarray(x), jnp.asarray(ly), self_interaction))
    vectors = [x] + [ly[:, i] for i in range(f)]
    expected = []
    for n in range(b):
        pairs = [vectors[i][n] @ vectors[j][n] for i in range(f + 1) for j in range(i + (1 if self_interaction else 0))]
        expected.append(np.concatenate([x[n], pairs]))
    np.testing.assert_allclose(out, np.stack(expected), rtol=1e-5, atol=1e-5)
    n_pairs = (f + 1) * f // 2 + (f + 1 if self_interaction else 0)
    assert out.shape == (b, d + n_pairs)


def test_cat_interaction_matches_numpy():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    ly = np.arange(16, dtype=np.float32).reshape(2, 2, 4)
    out = np.asarray(cat_interaction(jnp.asarray(x), jnp.asarray(ly)))
    np.testing.assert_array_equal(out, np.concatenate([x, ly[:, 0], ly[:, 1]], axis=1))


def test_dlrm_kaggle_shapes_and_param_count():
    model = DLRM(bottom_mlp=(512, 256, 64, 16), top_mlp=(512, 256, 1))
    dense, emb = jnp.ones((2, 13)), jnp.ones((2, 26, 16))
    params = model.init(jax.random.key(0), dense, emb)["params"]
    assert model.apply({"params": params}, dense, emb).shape == (2,)
    top_in = 16 + 27 * 26 // 2
    assert params["top_mlp"]["dense_0"]["kernel"].shape == (top_in, 512)
    widths = [13, 512, 256, 64, 16]
    bottom = sum(a * b + b for a, b in zip(widths, widths[1:], strict=False))
    top_widths = [top_in, 512, 256, 1]
    top = sum(a * b + b for a, b in zip(top_widths, top_widths[1:], strict=False))
    assert sum(p.size for p in jax.tree_util.tree_leaves(params)) == bottom + top


def test_dlrm_reference_init_statistics():
    """Weights N(0, sqrt(2/(fan_in+fan_out))), biases N(0, sqrt(1/fan_out)) as in facebookresearch/dlrm."""
    model = DLRM(bottom_mlp=(512, 512), top_mlp=(1,), interaction="cat")
    params = model.init(jax.random.key(1), jnp.ones((1, 256)), jnp.ones((1, 1, 4)))["params"]
    kernel = np.asarray(params["bottom_mlp"]["dense_1"]["kernel"])
    assert kernel.std() == pytest.approx(np.sqrt(2 / 1024), rel=0.02)
    bias = np.asarray(params["bottom_mlp"]["dense_1"]["bias"])
    assert bias.std() == pytest.approx(np.sqrt(1 / 512), rel=0.15)


def test_dlrm_dot_dim_mismatch_is_a_clear_error():
    model = DLRM(bottom_mlp=(8,), top_mlp=(1,))
    with pytest.raises(ValueError, match="bottom MLP's last width \\(8\\) to equal the embedding dim \\(16\\)"):
        model.init(jax.random.key(0), jnp.ones((2, 13)), jnp.ones((2, 3, 16)))
