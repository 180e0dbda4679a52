"""workers.controller_poll_s reaches Ray Train's controller: the variable we set is the one Ray Train V2
reads for its poll interval and hands from the driver to the controller; a user's own setting wins."""

from __future__ import annotations

import pytest

from pipeline.config import Config, ConfigError
from pipeline.train import driver as train


def test_the_variable_is_ray_trains_poll_interval_and_is_propagated_to_the_controller():
    from ray.train.v2._internal import constants

    assert train.CONTROLLER_POLL_ENV == constants.HEALTH_CHECK_INTERVAL_S_ENV_VAR
    assert train.CONTROLLER_POLL_ENV in constants.ENV_VARS_TO_PROPAGATE
    assert constants.DEFAULT_HEALTH_CHECK_INTERVAL_S == Config().workers.controller_poll_s  # Ray's default kept


def test_the_config_sets_the_interval_unless_the_user_set_the_variable(monkeypatch):
    cfg = Config()
    cfg.workers.controller_poll_s = 0.25
    monkeypatch.setattr(train, "_USER_CONTROLLER_POLL", "")
    assert train.controller_poll_s(cfg) == "0.25"
    monkeypatch.setattr(train, "_USER_CONTROLLER_POLL", "3")
    assert train.controller_poll_s(cfg) == "3"


def test_a_non_positive_interval_is_refused():
    cfg = Config()
    cfg.workers.controller_poll_s = 0
    with pytest.raises(ConfigError, match="workers.controller_poll_s"):
        cfg.validate()
