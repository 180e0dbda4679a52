"""`workers.num_workers = [min, max]`: parsing, the errors that name the key, Ray's arguments."""

from __future__ import annotations

import pytest

from pipeline.batch_plan.step_groups import worker_range
from pipeline.config import ConfigError, load_config
from pipeline.train import elastic


def cfg(*args: str):
    return load_config(None, list(args))


@pytest.mark.parametrize("value, message", [
    ("0,2", r"workers.num_workers: min must be >= 1, got \[0, 2\]"),
    ("3,2", r"workers.num_workers: min must be <= max, got \[3, 2\]"),
    ("1,2,3", r"workers.num_workers: a range is \[min, max\], got \[1, 2, 3\]"),
    ("two", r"workers.num_workers: expected int or list\[int\], got str 'two'"),
    ("0", r"workers.num_workers: must be >= 1"),
])
def test_bad_worker_counts_name_the_key(value, message):
    with pytest.raises(ConfigError, match=message):
        cfg(f"--workers.num_workers={value}")


def test_a_range_is_elastic_a_number_is_not():
    c = cfg("--workers.num_workers=1,4", "--workers.elastic_resize_interval_s=5")
    assert c.workers.num_workers == [1, 4] and worker_range(c) == (1, 4)
    assert elastic.scaling_kwargs(c) == {"num_workers": (1, 4), "elastic_resize_monitor_interval_s": 5.0}
    assert elastic.scaling_kwargs(cfg("--workers.num_workers=3")) == {"num_workers": 3}
    assert elastic.scaling_kwargs(cfg("--workers.num_workers=2,2")) == {"num_workers": 2}


def test_the_worker_count_is_in_no_cache_key(tmp_path):
    from workflows import runner

    keys = [runner.compute_keys(cfg(f"--run.work_dir={tmp_path}", f"--workers.num_workers={n}")) for n in ("8", "1,2")]
    assert keys[0] == keys[1]


def node(cpus: int, gpus: int = 0, kind: str = "", alive: bool = True) -> dict:
    res = {"CPU": float(cpus), **({"GPU": float(gpus)} if gpus else {})}
    if kind:
        res[f"accelerator_type:{kind}"] = 1.0
    return {"Alive": alive, "Resources": res}


def test_a_minimum_the_cluster_cannot_hold_fails_before_training():
    c = cfg("--workers.num_workers=3,4")
    elastic.check_cluster(c, [node(4), node(2)], use_gpu=False, cpus_per_worker=2)  # 2 + 1 workers fit
    with pytest.raises(elastic.ElasticConfigError, match=r"workers.num_workers = \[3, 4\]: the Ray cluster holds 2 CPU"):
        elastic.check_cluster(c, [node(4), node(2, alive=False)], use_gpu=False, cpus_per_worker=2)
    with pytest.raises(elastic.ElasticConfigError, match="holds 1 GPU"):
        elastic.check_cluster(c, [node(8, 1, "H100")], use_gpu=True, cpus_per_worker=1)


def test_gpus_of_different_kinds_fail_with_a_range():
    c = cfg("--workers.num_workers=1,2")
    elastic.check_cluster(c, [node(8, 1, "H100"), node(8, 1, "H100")], use_gpu=True, cpus_per_worker=1)
    with pytest.raises(elastic.ElasticConfigError, match=r"different kinds \(A10G, H100\)"):
        elastic.check_cluster(c, [node(8, 1, "H100"), node(8, 1, "A10G")], use_gpu=True, cpus_per_worker=1)
    elastic.check_cluster(cfg("--workers.num_workers=2"), [node(8, 1, "H100"), node(8, 1, "A10G")], use_gpu=True,
                          cpus_per_worker=1)  # a fixed count is the user's choice
