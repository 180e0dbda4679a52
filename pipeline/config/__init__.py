"""One typed config tree for the whole DAG, read from TOML with `--section.key=value` overrides.

- `schema`: the section dataclasses, `Config`, and the ``Literal`` types that spell each
  fixed set of allowed values once (`typing.get_args(Backend)` elsewhere);
- `loader`: the generic TOML + override loader (`load_config`, `from_dict`, `coerce`,
  `typed_fields`);
- `checks`: `ConfigError` and the checks both share;
- `devices`: what `"auto"` and the booleans of the per-device settings decide.

Part of the pipeline core: imports the standard library and `model.config` only.
"""

from .checks import ConfigError, parse_resources
from .loader import coerce, from_dict, load_config, parse_overrides, typed_fields
from .schema import (MOVED_KEYS, AttentionBackend, Auto, AverageSelect, Backend, CheckpointConfig, CheckpointUpload, Config,
                     DataConfig, DecodeSettings, EarlyStopMetric, EvalConfig, GradCompression, MetricsConfig, ModelSection,
                     Placement, PlanConfig, Precision, Preprocess, Quantization, RunConfig, Source, SpeedConfig, Split,
                     TrackingConfig, TrainConfig, VocabConfig, VocabModel, WorkersConfig, keyed_if_set, op)

__all__ = [
    "MOVED_KEYS", "AttentionBackend", "Auto", "AverageSelect", "Backend", "CheckpointConfig", "CheckpointUpload", "Config",
    "ConfigError", "DataConfig", "DecodeSettings", "EarlyStopMetric", "EvalConfig", "GradCompression", "MetricsConfig",
    "ModelSection", "Placement", "PlanConfig", "Precision", "Preprocess", "Quantization", "RunConfig", "Source",
    "SpeedConfig", "Split", "TrackingConfig", "TrainConfig", "VocabConfig", "VocabModel", "WorkersConfig",
    "coerce", "from_dict", "keyed_if_set", "load_config", "op", "parse_overrides", "parse_resources", "typed_fields",
]
