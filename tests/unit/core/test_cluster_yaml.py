"""cluster.yaml against the Ray cluster launcher's own schema, and the properties README.md ("Run on a cluster") relies on."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


def prepared(config: dict) -> dict:
    """What `ray up` does before launching anything: fill defaults, then validate."""
    config = prepare_config(copy.deepcopy(config))
    validate_config(config)
    return config


def test_cluster_yaml_passes_the_launcher_schema(raw):
    config = prepared(raw)
    assert config["head_node_type"] == "head"
    assert config["available_node_types"]["head"]["max_workers"] == 0


@pytest.mark.parametrize("where", ["top", "node_type"])
def test_a_misspelled_key_fails_validation(raw, where):
    bad = copy.deepcopy(raw)
    if where == "top":
        bad["head_start_ray_command"] = bad.pop("head_start_ray_commands")  # missing "s"
    else:
        bad["available_node_types"]["gpu_workers"]["min_worker"] = 1
    with pytest.raises(jsonschema.ValidationError, match="Additional properties are not allowed"):
        prepared(bad)


def test_head_runs_no_ray_work_and_workers_hold_eight_gpus(raw):
    types = raw["available_node_types"]
    assert types["head"]["resources"] == {"CPU": 0}
    workers = types["gpu_workers"]
    assert workers["min_workers"] == workers["max_workers"] == 1
    assert workers["node_config"]["InstanceType"] in ("p4d.24xlarge", "p5.48xlarge")  # 8 GPUs each
    assert "InstanceMarketOptions" not in workers["node_config"]  # on-demand


def test_a_spot_gpu_type_of_the_same_kind_starts_at_zero(raw):
    types = raw["available_node_types"]
    spot = types["gpu_workers_spot"]
    assert spot["min_workers"] == 0 and spot["max_workers"] >= 1
    assert spot["node_config"]["InstanceMarketOptions"] == {"MarketType": "spot"}
    # An elastic group must not mix GPU kinds (pipeline.train.elastic.check_cluster).
    assert spot["node_config"]["InstanceType"] == types["gpu_workers"]["node_config"]["InstanceType"]
    assert raw["max_workers"] == types["gpu_workers"]["max_workers"] + spot["max_workers"]


def test_services_are_not_exposed_and_token_auth_is_on(raw):
    head = " ".join(raw["head_start_ray_commands"])
    worker = " ".join(raw["worker_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "--dashboard-host=0.0.0.0" not in head
    assert "RAY_AUTH_MODE=token" in head and "RAY_AUTH_MODE=token" in worker
    assert raw["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert "mlflow server" in head and "--serve-artifacts" in head and "MLFLOW_TRACKING_URI=" in head


def test_mounted_project_paths_exist_and_no_credentials_in_the_file(raw):
    for remote, local in raw["file_mounts"].items():
        if not local.startswith("~"):
            assert (REPO / local).exists(), f"file_mounts {remote}: {local} is missing"
    text = (REPO / "cluster.yaml").read_text().lower()
    assert "aws_secret_access_key" not in text and "aws_access_key_id" not in text
