"""Method name (the config's `embedding.method`) -> EmbeddingMethod class."""

from compression.base import EmbeddingMethod, TableSpec
from compression.full import FullEmbedding

METHODS: dict[str, type[EmbeddingMethod]] = {
    "full": FullEmbedding,
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
