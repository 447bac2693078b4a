"""What a dataset looks like to the framework: dense features and sparse features with fixed bag sizes."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    """A sparse (categorical) feature as the data delivers it."""

    name: str
    vocab_size: int  # valid ids are [0, vocab_size)
    bag_size: int = 1  # L: ids per example, padded to this length; 1 = one-hot

    def __post_init__(self):
        if self.vocab_size < 1:
            raise ValueError(f"feature '{self.name}': vocab_size must be >= 1, got {self.vocab_size}")
        if self.bag_size < 1:
            raise ValueError(f"feature '{self.name}': bag_size must be >= 1, got {self.bag_size}")


# What a dataset's labels are: "binary" (clicks, 0 or 1: the models' output is a logit) or "regression" (a real
# value such as a star rating: the output is the prediction itself). recjax/task.py OBJECTIVES maps each to its loss,
# prediction and metrics.
TARGETS = ("binary", "regression")


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """Dense feature count and the sparse features, in the order the model sees them, and what the labels are."""

    num_dense: int
    features: tuple[FeatureSpec, ...]
    target: str = "binary"  # one of TARGETS

    def __post_init__(self):
        names = [f.name for f in self.features]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate sparse feature names: {names}")
        if self.num_dense < 0:
            raise ValueError(f"num_dense must be >= 0, got {self.num_dense}")
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {self.target!r}")

    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.features)


SPLITS = ("train", "validation", "test")  # every dataset has these: fit, select (early stopping), report
