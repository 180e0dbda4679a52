"""configs/cluster.toml, the guard against credentials in config values, and object-store error messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline import storage
from pipeline.config import ConfigError, load_config
from workflows.runner import compute_keys

REPO = Path(__file__).resolve().parents[3]


def test_cluster_config_is_the_base_recipe_on_shared_storage():
    base, cluster = load_config(REPO / "configs/base.toml"), load_config(REPO / "configs/cluster.toml")
    assert compute_keys(cluster) == compute_keys(base)  # same stages, same outputs: only where they live differs
    assert cluster.run.work_dir.startswith("s3://") and cluster.run.storage_path.startswith(cluster.run.work_dir)
    assert cluster.tracking.uri == ""  # the head's MLFLOW_TRACKING_URI (cluster.yaml)
    assert cluster.workers.num_workers == 8 and cluster.workers.use_gpu is True  # a GPU recipe (configs/base.toml)


OVERLAY = REPO / "configs/cluster-overlay.toml"
RECIPES = [p for p in sorted([*(REPO / "configs").glob("*.toml"), *(REPO / "configs").glob("table3/*.toml")])
           if not p.name.startswith("cluster")]


def test_cluster_toml_is_base_plus_the_overlay():
    combined, cluster = load_config([REPO / "configs/base.toml", OVERLAY]), load_config(REPO / "configs/cluster.toml")
    assert combined.to_dict() == cluster.to_dict()


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_the_overlay_moves_any_recipe_to_the_cluster_without_changing_a_key(recipe):
    alone, on_cluster = load_config(recipe), load_config([recipe, OVERLAY])
    assert compute_keys(on_cluster) == compute_keys(alone)
    assert on_cluster.run.work_dir == "s3://YOUR-BUCKET/transformer-base" and on_cluster.tracking.uri == ""
    assert on_cluster.run.name == alone.run.name and on_cluster.train == alone.train and on_cluster.model == alone.model


@pytest.mark.parametrize("key,value", [
    ("run.work_dir", "s3://AKIAEXAMPLE:s3cr3t@bucket/prefix"),
    ("run.storage_path", "s3://AKIAEXAMPLE@bucket/ray_train"),
    ("tracking.uri", "http://admin:s3cr3t@mlflow.example.com:5000"),
    ("data.mirror", "https://user:s3cr3t@mirror.example.com/statmt"),
])
def test_credentials_in_a_config_uri_are_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=f"^{key}: embeds credentials") as e:
        load_config(None, [f"--{key}={value}"])
    assert "s3cr3t" not in str(e.value)


def test_credentials_in_a_config_file_list_are_refused(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[data]\nsource = "custom"\ntrain_src = ["https://u:s3cr3t@host/a.en"]\n'
                    'train_tgt = ["b.de"]\ndev_src = "d"\ndev_tgt = "d"\ntest_src = "t"\ntest_tgt = "t"\n')
    with pytest.raises(ConfigError, match="^data.train_src: embeds credentials"):
        load_config(path)


@pytest.mark.parametrize("value", ["s3://bucket/a@b/c", "http://127.0.0.1:5000", "work/x@y", "gs://b/p"])
def test_ordinary_uris_pass(value):
    assert load_config(None, [f"--run.work_dir={value}"]).run.work_dir == value


@pytest.mark.parametrize("raw,hint", [
    ("When initiating multiple part upload for key 'x' in bucket 'b': AWS Error NO_SUCH_BUCKET during "
     "CreateMultipartUpload operation: The specified bucket does not exist", "the bucket does not exist"),
    ("When getting information for key 'x' in bucket 'b': AWS Error ACCESS_DENIED during HeadObject operation",
     "credentials were refused"),
    ("AWS Error NETWORK_CONNECTION during HeadObject operation: curlCode: 7, Could not connect to server",
     "does not answer"),
    # CI's own failure: the port 40365 read as HTTP 403
    ("When getting information for key 'wd-bad' in bucket 'b': AWS Error NETWORK_CONNECTION during HeadObject "
     "operation: curlCode: 7, Could not connect to server; Details: Failed to connect to 127.0.0.1 port 40365 "
     "after 0 ms: Could not connect to server", "does not answer"),
    # names are not causes: a key called 'credentials-2026' says nothing of the credentials
    ("When getting information for key 'credentials-2026' in bucket 'b': AWS Error NETWORK_CONNECTION during "
     "HeadObject operation: curlCode: 7, Could not connect to server", "does not answer"),
    # no AWS code: the free text decides, a whole 403 is a refusal
    ("HTTP status 403 from http://minio.internal:9000", "credentials were refused"),
    ("Unexpected reply, HTTP status 500", "check the bucket name, the endpoint"),
])
def test_object_store_errors_name_the_endpoint_bucket_and_cause(raw, hint, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio.internal:9000")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    msg = storage.describe_error("s3://b/wd", OSError(raw), "write to")
    assert msg.startswith("cannot write to s3://b/wd (bucket 'b' at http://minio.internal:9000 (from AWS_ENDPOINT_URL))")
    assert hint in msg and raw.split(":")[0] in msg


def test_local_write_error_names_the_path(tmp_path):
    target = tmp_path / "file"
    target.write_text("")
    with pytest.raises(storage.StorageAccessError, match=f"cannot write to {target}/wd"):
        storage.check_access(str(target / "wd"))  # a file where the work dir's parent should be
