"""Method name (the config's `embedding.method`) -> EmbeddingMethod class."""

from compression.base import EmbeddingMethod, TableSpec
from compression.compositional import ChineseRemainder, MixedRadix, PathQuotientRemainder, QuotientRemainder
from compression.fiited import FiitedEmbedding, RowPruneEmbedding, UniformDimEmbedding
from compression.full import FullEmbedding
from compression.hashing import HashingEmbedding
from compression.mixed_dim import MixedDimBlocks, MixedDimEmbedding
from compression.tt import TTEmbedding

METHODS: dict[str, type[EmbeddingMethod]] = {
    "full": FullEmbedding,
    "hashing": HashingEmbedding,  # hashing trick, modulo or universal, optional sign hash
    "qr": QuotientRemainder,  # quotient-remainder trick (Shi et al. 2019)
    "mixed_radix": MixedRadix,  # generalised QR: one table per mixed-radix digit
    "crt": ChineseRemainder,  # Chinese-remainder partitions, pairwise coprime moduli
    "qr_path": PathQuotientRemainder,  # path-based compositional embedding (Shi et al. §4)
    "md": MixedDimEmbedding,  # mixed dims per table (Ginart et al. 2019), dims from compression.plan
    "md_blocks": MixedDimBlocks,  # mixed dims per frequency block within a table
    "tt": TTEmbedding,  # TT-Rec tensor-train cores (Yin et al. 2021)
    "fiited": FiitedEmbedding,  # per-row dynamic dims in a chunk pool, adjusted in training (Luo et al. 2024)
    "row_prune": RowPruneEmbedding,  # in-training magnitude pruning of whole rows (FIITED's baseline)
    "uniform_dim": UniformDimEmbedding,  # every row budget x D wide, zero tail (FIITED's baseline)
}


def build_method(spec: TableSpec) -> EmbeddingMethod:
    """The method object for a logical table; unknown names fail with the list of known ones."""
    try:
        cls = METHODS[spec.method]
    except KeyError:
        raise ValueError(
            f"table '{spec.name}': unknown embedding method '{spec.method}'; known: {sorted(METHODS)}"
        ) from None
    return cls(spec)
