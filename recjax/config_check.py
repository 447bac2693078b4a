"""One validation pass over a resolved config before any work: types, ranges, mutually exclusive keys, model and
embedding shapes that must agree, and the data directory's contents.

Every problem is a `ConfigError` naming the dotted key (`train.steps: must be a whole number >= 1, got 0`), which
the launchers print as one line. Each section is checked next to the code that owns it (the helpers are in
recjax/validation.py); this module runs them in order and returns the config's typed sections (recjax/sections.py).
`train_and_evaluate` calls `validate_config` first, so programmatic callers (sweeps, notebooks) get the same
messages. Checks that need the data's spec (a table plan, a cross layer's rank against its width) run when the task
is built and are turned into ConfigErrors by `validation.config_errors`.
"""

import ml_collections

from recjax.checkpoint.config import check_checkpoint_config
from recjax.data import check_data_config
from recjax.embedding import check_embedding
from recjax.evaluation import check_train
from recjax.models import check_model, check_model_defaults
from recjax.placement import check_placement
from recjax.sections import Sections, read_sections
from recjax.task import check_optimizer
from recjax.validation import get, integer


def validate_config(config: ml_collections.ConfigDict) -> Sections:
    """Raise a ConfigError naming the first bad key of `config`; else its typed sections (recjax/sections.py), which
    the run's components receive."""
    integer(config, "seed", 0)
    check_train(config)
    check_checkpoint_config(config)
    check_optimizer(config)
    check_embedding(config)
    check_model(config)
    check_model_defaults(config)
    check_placement(config)
    check_data_config(get(config, "data"))
    return read_sections(config)
