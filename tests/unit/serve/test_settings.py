"""``serve run``'s arguments: decode defaults from DecodeSettings, autoscaling and backpressure as
Ray Serve reads them (its own Deployment validation, no cluster needed), errors naming the key."""

from __future__ import annotations

import pytest

from pipeline.config import ConfigError, DecodeSettings
from pipeline.serve.app import ServeSettings, Translation, deployment_options

PATHS = {"model_dir": "/m", "spm": "/s"}


def test_decode_defaults_are_the_config_defaults():
    s = ServeSettings.from_args(PATHS)
    assert DecodeSettings.of(s) == DecodeSettings() == DecodeSettings(4, 0.6, 1.0, 50)  # §6.1


def test_autoscaling_and_backpressure_reach_ray_serve():
    s = ServeSettings.from_args({**PATHS, "min_replicas": "1", "max_replicas": "3", "max_ongoing_requests": "4",
                                 "max_queued_requests": "2", "retry_after_s": "3"})
    cfg = Translation.options(**deployment_options(s))._deployment_config  # Ray validates it here
    assert (cfg.autoscaling_config.min_replicas, cfg.autoscaling_config.max_replicas) == (1, 3)
    assert (cfg.max_ongoing_requests, cfg.max_queued_requests) == (4, 2)
    assert cfg.backpressure_config.retry_after_s == 3 and cfg.backpressure_config.status_code == 503
    fixed = Translation.options(**deployment_options(ServeSettings.from_args({**PATHS, "num_replicas": "2"})))
    assert fixed.num_replicas == 2 and fixed._deployment_config.autoscaling_config is None


@pytest.mark.parametrize("args, words", [
    ({"num_replicas": "2", "max_replicas": "3"}, "num_replicas (fixed) and max_replicas (autoscaling)"),
    ({"min_replicas": "4", "max_replicas": "3"}, "min_replicas (4) <= max_replicas (3)"),
    ({"max_ongoing_requests": "0"}, "max_ongoing_requests=0: must be >= 1"),
    ({"beam": "5"}, "beam: unknown config key in serve run's arguments"),
    ({"beam_size": "0"}, "beam_size: must be >= 1"),
    ({"backend": "onnx"}, "backend='onnx': must be torch or ctranslate2"),
])
def test_bad_arguments_are_named(args, words):
    with pytest.raises(ConfigError) as e:
        ServeSettings.from_args({**PATHS, **args})
    assert words in str(e.value)
