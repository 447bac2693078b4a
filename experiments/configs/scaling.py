r"""The scaling-law sweep's data and model ladders (experiments/sweep_scaling.py); one config per (family, size).

    python -m experiments.train --config=experiments/configs/scaling.py:wukong,3     # one point of the sweep

Data: the synthetic Criteo-like generator (26 sparse features, 13 dense) with the *hard teacher*
(recjax/data/synthetic.py). Besides its per-id biases, 16 pairwise field interactions and a dense term, it has a
spectrum of 64 high-order field tuples of orders 3 and 4, tuple m weighted (m + 1)^-0.5, each contributing the
staircase product sum_k prod_{f in tuple} (1 + v_f[k]). The high-order term carries most of the logit's variance
(weights 0.3, 0.3, 0.2, 1.0 for bias, pairs, dense, high-order). Vocabularies are capped at 100 ids so that
every id is seen thousands of times within the example budget: what separates the models is how well their dense
part models the interactions, not how well rare ids are learnt. The teacher's logloss (`bayes_logloss` in every
summary.json) is the floor.

Budget: every point trains on the same stream, 1500 steps of 512 examples (768k examples, one pass), with the
same optimizers (Adam for dense params, lazy Adam 3e-3 for embedding rows), and is evaluated on the same 32k
held-out examples. The dense learning rate here is 1e-3; the sweep tunes it per point (sweep_scaling.py).

Ladders: sizes grow along each family's own axes, spanning about two orders of magnitude of FLOPs per example.
  wukong  the paper's recipe (Zhang et al. 2024, sec. 5): layers l first (1, 2, 4), then width together:
          n_F = n_L, the FM rank k, the FMB MLP width and the top MLP.
  dlrm    the top MLP (width, then depth) with the bottom MLP growing alongside; dot interaction.
  dcnv2   cross layers first, then the low rank r, then the deep MLP (stacked, as MLPerf DLRMv2).
Embeddings are identical (dim 16, full tables) for every point: scaling is in the dense compute.

What the sweep found (figures and commands: benchmarks/RESULTS.md#scaling-law): at this budget every family stays
well above the teacher and Wukong is behind DLRM and DCNv2 at equal FLOPs. The budget, not the teacher, is what
binds: with 4x the examples the families nearly meet (Wukong learns slower per example), and past the middle sizes
the returns are small; the sizes that separate are the small ones. Of the teachers tried, a random tanh network over
all fields was learnt to the same level by every size, and zero-mean products by none; the staircase products
separate the sizes.
"""

import ml_collections

from experiments.configs import dcnv2_synthetic, dlrm_synthetic, wukong_synthetic

VOCAB_CAP = 100
STEPS = 1500
BATCH_SIZE = 512

LADDERS: dict[str, list[dict]] = {
    "wukong": [
        dict(num_layers=1, fmb_embeddings=4, lcb_embeddings=4, fm_rank=4, fmb_mlp_width=32, top_mlp=(32, 1)),
        dict(num_layers=2, fmb_embeddings=4, lcb_embeddings=4, fm_rank=4, fmb_mlp_width=32, top_mlp=(32, 1)),
        dict(num_layers=4, fmb_embeddings=4, lcb_embeddings=4, fm_rank=4, fmb_mlp_width=32, top_mlp=(32, 1)),
        dict(num_layers=4, fmb_embeddings=8, lcb_embeddings=8, fm_rank=8, fmb_mlp_width=64, top_mlp=(128, 1)),
        dict(num_layers=4, fmb_embeddings=16, lcb_embeddings=16, fm_rank=16, fmb_mlp_width=256,
             top_mlp=(256, 64, 1)),
        dict(num_layers=4, fmb_embeddings=32, lcb_embeddings=32, fm_rank=24, fmb_mlp_width=512,
             top_mlp=(512, 128, 1)),
    ],
    "dlrm": [
        dict(bottom_mlp=(16,), top_mlp=(16, 1)),
        dict(bottom_mlp=(32, 16), top_mlp=(64, 1)),
        dict(bottom_mlp=(64, 16), top_mlp=(128, 64, 1)),
        dict(bottom_mlp=(128, 64, 16), top_mlp=(256, 128, 1)),
        dict(bottom_mlp=(256, 64, 16), top_mlp=(512, 256, 1)),
        dict(bottom_mlp=(512, 256, 64, 16), top_mlp=(2048, 1024, 512, 1)),
    ],
    "dcnv2": [
        dict(bottom_mlp=(16,), num_cross_layers=1, low_rank=4, deep_mlp=(16,)),
        dict(bottom_mlp=(32, 16), num_cross_layers=2, low_rank=8, deep_mlp=(64,)),
        dict(bottom_mlp=(64, 16), num_cross_layers=3, low_rank=16, deep_mlp=(128, 64)),
        dict(bottom_mlp=(64, 16), num_cross_layers=3, low_rank=64, deep_mlp=(256, 64)),
        dict(bottom_mlp=(128, 64, 16), num_cross_layers=4, low_rank=128, deep_mlp=(512, 256)),
        dict(bottom_mlp=(256, 64, 16), num_cross_layers=4, low_rank=256, deep_mlp=(1024, 1024, 256)),
    ],
}
FAMILY_CONFIGS = {"wukong": wukong_synthetic, "dlrm": dlrm_synthetic, "dcnv2": dcnv2_synthetic}


def hard_teacher_data(data: ml_collections.ConfigDict) -> None:
    """Turn a synthetic `config.data` (dlrm_synthetic.py's) into the scaling sweep's data, in place."""
    data.vocab_cap = VOCAB_CAP
    data.vocab_sizes = tuple(min(v, VOCAB_CAP) for v in data.vocab_sizes)
    data.zipf_exponent = 1.1
    data.eval_examples = 32_768
    teacher = data.teacher
    teacher.dim = 4
    teacher.pairs = 16
    teacher.tuples = 64
    teacher.order = 4
    teacher.decay = 0.5
    teacher.logit_scale = 3.0
    teacher.weights = (0.3, 0.3, 0.2, 1.0)


def point_config(family: str, size: int, ladders: dict[str, list[dict]] | None = None
                 ) -> ml_collections.ConfigDict:
    """The config of `family` at ladder index `size`: the family's synthetic config, the hard-teacher data, the
    sweep's budget and the ladder's model knobs."""
    ladders = LADDERS if ladders is None else ladders
    if family not in ladders:
        raise ValueError(f"unknown model family '{family}'; choose from {sorted(ladders)}")
    if not 0 <= size < len(ladders[family]):
        raise ValueError(f"{family} has sizes 0..{len(ladders[family]) - 1}, got {size}")
    config = FAMILY_CONFIGS[family].get_config()
    hard_teacher_data(config.data)
    for key, value in ladders[family][size].items():
        if key not in config.model[family]:
            raise ValueError(f"{family} ladder knob '{key}' is not a field of config.model.{family}")
        config.model[family][key] = value
    config.train.batch_size = BATCH_SIZE
    config.train.steps = STEPS
    config.train.eval_every = STEPS  # one evaluation, at the end
    config.train.log_every = 250
    return config


def get_config(arg: str = "wukong,0") -> ml_collections.ConfigDict:
    """`arg` = "family,size", e.g. "dcnv2,2"."""
    family, _, size = arg.partition(",")
    try:
        index = int(size or 0)
    except ValueError:
        raise ValueError(f"expected 'family,size' such as 'wukong,3', got '{arg}'") from None
    return point_config(family.strip(), index)
