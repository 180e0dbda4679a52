"""One typed config tree for the whole DAG, read from TOML with `--section.key=value` overrides.

- `schema`: the recipe's and the other stages' section dataclasses, `Config`, and the ``Literal``
  types that spell each fixed set of allowed values once (`typing.get_args(Backend)` elsewhere);
- `loader`: the generic TOML + override loader (`load_config`, `from_dict`, `coerce`,
  `typed_fields`);
- `operations`: the operational sections beside the recipe (speed, workers, checkpoint, metrics,
  plan) and `op`, the mark of a field no cache key holds;
- `checks`: `ConfigError` and the checks both share;
- `devices`: what `"auto"` and the booleans of the per-device settings decide.
- `reference`: every key with its type, default and meaning (the schema's comments), for
  ``--help``, docs/configuration.md's generated tables and ``--print-config``'s TOML.

Part of the pipeline core: imports the standard library and `model.config` only.
"""

from .checks import ConfigError, parse_resources
from .loader import coerce, from_dict, load_config, parse_overrides, typed_fields
from .migrations import MOVED_KEYS, keyed_if_set
from .operations import (AttentionBackend, Auto, CheckpointSection, CheckpointUpload, GradCompression, MetricsSection,
                         Placement, PlanSection, Precision, SpeedSection, WorkersSection, op)
from .schema import (AverageSection, AverageSelect, Backend, Config, DataSection, DecodeSection, DecodeSettings,
                     DevBleuSection, EarlyStopMetric, ModelSection, Preprocess, Quantization, RunSection, ScoreSection,
                     Source, Split, TrackingSection, TrainSection, VocabModel, VocabSection)

__all__ = [
    "MOVED_KEYS", "AttentionBackend", "Auto", "AverageSection", "AverageSelect", "Backend", "CheckpointSection",
    "CheckpointUpload", "Config", "ConfigError", "DataSection", "DecodeSection", "DecodeSettings", "DevBleuSection",
    "EarlyStopMetric", "GradCompression", "MetricsSection", "ModelSection", "Placement", "PlanSection", "Precision",
    "Preprocess", "Quantization", "RunSection", "ScoreSection", "Source", "SpeedSection", "Split", "TrackingSection",
    "TrainSection", "VocabModel", "VocabSection",
    "WorkersSection", "coerce", "from_dict", "keyed_if_set", "load_config", "op", "parse_overrides",
    "parse_resources", "typed_fields",
]
