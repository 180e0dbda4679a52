"""What the stages about to run ask of the Ray cluster, checked as soon as the driver reaches it
(workflows/preflight.py: `check_cluster`): clusters described by hand (a one-GPU box, an 8-GPU
node, an autoscaling cluster, two hosts) with the shipped configs, a hand-written mount table,
and the driver on the test session's real local Ray."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.dag import ORDER, compute_keys
from workflows import reproduce_base
from pipeline.ray_env import Cluster, connected_cluster
from workflows.preflight import check_cluster, filesystem_of, shared_by_every_node

REPO = Path(__file__).resolve().parents[3]
BASE, ONE_GPU = REPO / "configs" / "base.toml", REPO / "configs" / "one-gpu.toml"
GPU_BOX = {"CPU": 16.0, "GPU": 1.0}
MOUNTS = """overlay / overlay rw 0 0
/dev/sda1 /work ext4 rw 0 0
nas:/export /mnt/shared nfs4 rw 0 0
nas:/export/x /mnt/shared/local\\040disk ext4 rw 0 0
s3fs /mnt/bucket fuse.s3fs rw 0 0
"""


def one_host(*nodes: dict[str, float], types=()) -> Cluster:
    return Cluster(frozenset({"10.0.0.1"}), tuple(nodes), tuple(types))


@pytest.fixture
def mounts(tmp_path) -> str:
    path = tmp_path / "mounts"
    path.write_text(MOUNTS)
    return str(path)


def test_a_one_gpu_box_refuses_eight_workers_by_name_and_runs_the_overlay():
    base = load_config(BASE)
    with pytest.raises(ConfigError, match=r"^workers.num_workers = 8: .*can never hold 8 GPU worker.*"
                                          r"--workers.num_workers=1.*configs/one-gpu.toml"):
        check_cluster(base, one_host(GPU_BOX), ORDER)
    check_cluster(base, one_host(GPU_BOX), ["score"])  # rescoring asks for no worker
    check_cluster(load_config([BASE, ONE_GPU]), one_host(GPU_BOX), ORDER)
    check_cluster(base, one_host({"CPU": 96.0, "GPU": 8.0}), ORDER)  # the paper's 8-GPU node


def test_the_one_gpu_overlay_changes_no_cache_key():
    assert compute_keys(load_config([BASE, ONE_GPU])) == compute_keys(load_config(BASE))


def test_workers_that_only_an_autoscaler_can_add_are_waited_for():
    base = load_config(BASE, ["--run.work_dir=s3://b/w", "--tracking.uri=http://head:5000"])  # shared storage
    head = {"CPU": 8.0}
    check_cluster(base, one_host(head, types=[({"CPU": 96.0, "GPU": 8.0}, 2)]), ORDER)
    with pytest.raises(ConfigError, match=r"^workers.num_workers = 8: .*autoscaler's maximum"):
        check_cluster(base, one_host(head, types=[({"CPU": 48.0, "GPU": 4.0}, 1)]), ORDER)


def test_a_gpu_recipe_on_a_cpu_cluster_is_refused_by_its_key():
    with pytest.raises(ConfigError, match=r"^workers.use_gpu = true but the Ray cluster has no GPU"):
        check_cluster(load_config(BASE), one_host({"CPU": 64.0}), ["train"])


def test_cpu_workers_that_fit_on_no_node_are_refused():
    local = load_config(REPO / "configs" / "local.toml")
    check_cluster(local, one_host({"CPU": 2.0}), ORDER)
    asks = load_config(REPO / "configs" / "local.toml", ["--workers.num_workers=2", "--workers.cpus_per_worker=2"])
    with pytest.raises(ConfigError, match=r"^workers.num_workers = 2: .*2 CPU worker.*--workers.num_workers=1"):
        check_cluster(asks, one_host({"CPU": 2.0}), ["train"])
    # two nodes of 2 CPUs hold two 2-CPU workers, one node of 3 CPUs only one
    check_cluster(asks, Cluster(frozenset({"h"}), ({"CPU": 2.0}, {"CPU": 2.0})), ["train"])
    with pytest.raises(ConfigError):
        check_cluster(asks, one_host({"CPU": 3.0}), ["train"])


def test_dev_bleu_and_translate_actors_that_can_never_be_placed():
    one = load_config([BASE, ONE_GPU], ["--dev_bleu.resources=CPU=32"])
    with pytest.raises(ConfigError, match=r"^dev_bleu.resources = 'CPU=32': no node"):
        check_cluster(one, one_host(GPU_BOX), ["train"])
    eight = load_config([BASE, ONE_GPU], ["--decode.num_workers=8"])
    with pytest.raises(ConfigError, match=r"^decode.num_workers = 8: .*GPU translate actors.*--decode.num_workers=1"):
        check_cluster(eight, one_host(GPU_BOX), ["translate"])


def test_the_filesystem_of_a_path_is_its_longest_mount(mounts):
    assert filesystem_of("/work/main", mounts) == "ext4"
    assert filesystem_of("/mnt/shared/runs/base", mounts) == "nfs4"
    assert filesystem_of("/mnt/shared/local disk/x", mounts) == "ext4"  # a mount inside the share
    assert filesystem_of("/mnt/sharedness", mounts) == "overlay"  # not under /mnt/shared
    assert filesystem_of("file:///mnt/bucket/w", mounts) == "fuse.s3fs"
    assert shared_by_every_node("/mnt/bucket/w", mounts) and shared_by_every_node("s3://b/w", mounts)
    assert not shared_by_every_node("/work/w", mounts)
    assert filesystem_of(str(REPO)) != ""  # this machine's real table answers


def test_two_hosts_refuse_local_storage_and_a_local_store_by_key(mounts):
    two = Cluster(frozenset({"10.0.0.1", "10.0.0.2"}), (GPU_BOX, GPU_BOX))
    grows = one_host(GPU_BOX, types=[(GPU_BOX, 4)])

    def check(*overrides: str, cluster: Cluster = two) -> None:
        cfg = load_config([BASE, ONE_GPU], ["--run.work_dir=/work/base", *overrides])
        check_cluster(cfg, cluster, ["score"], mounts=mounts)

    for cluster in (two, grows):
        with pytest.raises(ConfigError, match=r"^run.work_dir = '/work/base' is on this machine's disk \(ext4"):
            check(cluster=cluster)
    with pytest.raises(ConfigError, match=r"^run.storage_path = '/work/rt' is on this machine's disk"):
        check("--run.work_dir=s3://b/w", "--run.storage_path=/work/rt", "--tracking.uri=http://head:5000")
    with pytest.raises(ConfigError, match=r"^tracking.uri: the runs would go to sqlite:////mnt/shared/w/mlflow.db"):
        check("--run.work_dir=/mnt/shared/w")  # the default store: SQLite under the work dir, even on NFS
    with pytest.raises(ConfigError, match=r"^tracking.uri: .*file:///work/mlruns"):
        check("--run.work_dir=/mnt/shared/w", "--tracking.uri=file:///work/mlruns")
    check("--run.work_dir=/mnt/shared/w", "--tracking.uri=file:///mnt/shared/mlruns")
    check("--run.work_dir=s3://b/w", "--tracking.uri=http://head:5000")
    check("--run.work_dir=/work/base", "--tracking.enabled=false", cluster=one_host(GPU_BOX))  # one host: its disk


@pytest.mark.slow
def test_the_driver_refuses_in_seconds_on_a_real_ray(ray_local, tmp_path, capsys):
    """The session's local Ray (2 CPUs) as the driver reaches it: one host, no autoscaler; two
    2-CPU workers are refused before any stage runs, naming the key."""
    cluster = connected_cluster()
    assert len(cluster.hosts) == 1 and not cluster.node_types and cluster.most("CPU") == 2
    work = tmp_path / "work"
    started = time.monotonic()
    rc = reproduce_base.main(["--config", "configs/local.toml", f"--run.work_dir={work}",
                              "--workers.num_workers=2", "--workers.cpus_per_worker=2"])
    assert rc == 2 and time.monotonic() - started < 60
    assert "error: workers.num_workers = 2: the Ray cluster can never hold 2 CPU worker(s)" in capsys.readouterr().err
    assert not [p for p in work.iterdir() if p.name in ORDER], "a stage ran before the check"
