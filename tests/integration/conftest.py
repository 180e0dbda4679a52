"""Integration fixtures: the tiny Transformer (tests/conftest.py) exported for the export / backend / serve
tests, and one MLflow server for the tests that track to a server."""

from __future__ import annotations

from typing import Iterator

import pytest


@pytest.fixture(scope="session")
def tiny_export(tiny_model, tmp_path_factory) -> dict:
    """The tiny model exported: ``{"hf", "ct2_float32", "ct2_int8"}`` folders."""
    from pathlib import Path

    from pipeline.decoding.conversion import export_all

    out = tmp_path_factory.mktemp("tiny_export")
    return export_all(tiny_model["model"], tiny_model["model_config"], tiny_model["spm"], Path(out))


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory) -> Iterator[str]:
    """One MLflow tracking server (SQLite store, served artifacts) for the session's tests that
    track to a server (the cluster job, the elastic run, the registry, the tracking outages, which
    reach it through a proxy they switch off: tests/support/flaky_proxy.py). Each test uses its own
    experiment or run names, so they never read each other's runs."""
    from tests.support.mlflow_server import mlflow_server

    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri
