"""Shared fixtures: the offline WMT14 mirror, a local Ray, small configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Ray Train's controller polls its workers every 0.5 s in the suite instead of the product's 2 s
# (workers.controller_poll_s; a driver's explicit variable wins, and every driver, Ray node and job the
# tests start inherits it): the tests' runs train a few dozen tiny steps, so each of their train stages
# spent ~5 s waiting for polls. A long run on 2 cores trains ~12% slower at 0.5 s, so the product keeps
# Ray's default (docs/benchmarks.md, "Ray Train's poll interval").
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
# tests/support/test_data.py is `make test-data`'s script, not a test module (its name matches test_*.py).
collect_ignore = ["support/test_data.py"]


def _offline_data(var: str, sub: str, what: str) -> Path:
    """$var, else ../shared/data/<sub>, else .test-data/<sub>; none of them: the test skips, naming
    `make test-data`."""
    from tests.support.test_data import data_dir, missing

    path = data_dir(var, sub)
    if path is None:
        pytest.skip(missing(f"{what} ({sub})", var))
    return path


@pytest.fixture(scope="session")
def mirror_dir() -> Path:
    """The offline stand-in for statmt.org (real archive layouts, sampled data): $WMT14_MIRROR, else
    ../shared/data/statmt-mirror, else .test-data/statmt-mirror (`make test-data`)."""
    return _offline_data("WMT14_MIRROR", "statmt-mirror", "the offline WMT14 mirror")


@pytest.fixture(scope="session")
def multi30k_dir() -> Path:
    """The offline stand-in for github.com/multi30k/dataset/raw/<commit>/: $MULTI30K_MIRROR, else
    ../shared/data/multi30k, else .test-data/multi30k (`make test-data`)."""
    return _offline_data("MULTI30K_MIRROR", "multi30k", "the offline Multi30k mirror")


@pytest.fixture(scope="session")
def synthetic_mirror(tmp_path_factory) -> Path:
    """A statmt.org-shaped mirror of generated EN-DE text (tests/support/synthetic_mirror.py), for
    the tests whose point is the plumbing, not the real text: written here, so they never skip."""
    from tests.support.synthetic_mirror import write_mirror

    return write_mirror(tmp_path_factory.mktemp("synthetic_mirror"))


@pytest.fixture(scope="session")
def wmt14_dir() -> Path:
    """Plain-text newstest2013/2014 and training samples: $WMT14_DATA, else ../shared/data/wmt14, else
    .test-data/wmt14 (`make test-data`)."""
    return _offline_data("WMT14_DATA", "wmt14", "the WMT14 test files")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> dict:
    """A 2+2-layer model trained ~20 s on the generated toy language (tests/support/tiny_model.py),
    and its SentencePiece model: ``{"model", "model_dir", "model_config", "spm", "test_en",
    "test_de"}``, the last two 200 held-out sentence pairs to translate; the export, backend,
    registry and serve tests use it. No data files: it runs on any clone."""
    from tests.support.tiny_model import TOY_TEST_SEED, toy_pairs, train_tiny_model

    tiny = train_tiny_model(toy_pairs(8000), tmp_path_factory.mktemp("tiny_model"))
    tiny["test_en"], tiny["test_de"] = toy_pairs(200, TOY_TEST_SEED)
    return tiny


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the whole test session (2 CPUs), started as the driver starts its own
    (pipeline.ray_env: its workers know its address; the dashboard stays on, which Ray Train's
    placement-group cleaner needs), shut down at the end."""
    import ray

    from pipeline.ray_env import start_local_ray

    if not ray.is_initialized():
        start_local_ray(num_cpus=2, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def pytest_collection_modifyitems(config, items):
    """Mark the fast tier: every test under tests/unit/ not marked slow gets `fast`, so that
    `pytest tests -m "not fast"` is the slow tier (the rest) without re-running the fast one."""
    unit = REPO / "tests" / "unit"
    for item in items:
        if Path(item.path).is_relative_to(unit) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.fast)
