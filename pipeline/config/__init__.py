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
from .loader import MOVED_KEYS, coerce, from_dict, load_config, parse_overrides, typed_fields
from .operations import (AttentionBackend, Auto, CheckpointConfig, CheckpointUpload, GradCompression, MetricsConfig,
                         Placement, PlanConfig, Precision, SpeedConfig, WorkersConfig, op)
from .schema import (AverageSelect, Backend, Config, DataConfig, DecodeSettings, EarlyStopMetric, EvalConfig,
                     ModelSection, Preprocess, Quantization, RunConfig, Source, Split, TrackingConfig, TrainConfig,
                     VocabConfig, VocabModel, keyed_if_set)

__all__ = [
    "MOVED_KEYS", "AttentionBackend", "Auto", "AverageSelect", "Backend", "CheckpointConfig", "CheckpointUpload",
    "Config", "ConfigError", "DataConfig", "DecodeSettings", "EarlyStopMetric", "EvalConfig", "GradCompression",
    "MetricsConfig", "ModelSection", "Placement", "PlanConfig", "Precision", "Preprocess", "Quantization", "RunConfig",
    "Source", "SpeedConfig", "Split", "TrackingConfig", "TrainConfig", "VocabConfig", "VocabModel", "WorkersConfig",
    "coerce", "from_dict", "keyed_if_set", "load_config", "op", "parse_overrides", "parse_resources", "typed_fields",
]
