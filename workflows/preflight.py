"""Checks both entry scripts run before any GPU time (reproduce_base.py, reproduce_table3.py):
`preflight` on the config and its storage (also for ``--plan``), and `check_cluster` on what the
stages about to run ask of the Ray cluster, once it is reached (workflows/session.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Collection

from pipeline import storage
from pipeline.config import Config, ConfigError
from pipeline.config.devices import use_gpus
from pipeline.ray_env import Cluster, connected_cluster

log = logging.getLogger(__name__)


def preflight(cfg: Config, write: bool = True, check_tracking: bool = True) -> None:
    """Clear errors before any GPU time: the work dir (and Ray Train's storage path) can be
    written (with ``write=False``, read: enough for ``--plan``), tracking answers, translate's
    engine holds the model."""
    from pipeline import tracking

    check_decoding_engine(cfg)
    check_corpora(cfg)

    for key in ("work_dir", "storage_path"):
        uri = getattr(cfg.run, key)
        if not uri:
            continue
        try:
            storage.check_access(uri, write=write)
        except OSError as e:
            raise ConfigError(f"run.{key}: {e}") from e
    if cfg.tracking.enabled and check_tracking:
        uri = tracking.tracking_uri_for(cfg)
        tracking.check_reachable(uri)
        if storage.is_remote(cfg.run.work_dir) and uri.startswith("sqlite:"):
            log.warning("tracking: the work dir is on an object store but MLflow writes to %s on this "
                        "machine only; set tracking.uri or MLFLOW_TRACKING_URI to a server to keep the runs",
                        uri)


def check_corpora(cfg: Config) -> None:
    """data.corpora names training corpora of this language pair's registry (pipeline/data/sources.py)."""
    if cfg.data.source != "wmt14" or not cfg.data.corpora:
        return
    from pipeline.data import sources

    try:
        sources.chosen(sources.wmt14(cfg.data.src_lang, cfg.data.tgt_lang), cfg.data.corpora)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def check_decoding_engine(cfg: Config) -> None:
    """decode.backend = "ctranslate2" decodes with the export stage's CTranslate2 model, which a model
    neither export route holds never gets (`conversion.ct2_unexportable`): refused now, not after
    training. Dev BLEU needs no check: it decodes such a model with our beam search (and says so)."""
    if cfg.decode.backend != "ctranslate2":
        return
    from model import ModelConfig
    from pipeline.decoding.conversion import ct2_unexportable

    why = ct2_unexportable(ModelConfig.of(cfg.model, cfg.vocab.size))
    if why:
        raise ConfigError(f"decode.backend = 'ctranslate2': the export stage gives this [model] no CTranslate2 "
                          f"model ({why}); use decode.backend = 'torch'")


# ---------------------------------------------------------------------------------------------
# The cluster: what a run asks of it against what it has, once Ray is reached, before any stage

# Filesystems every node of a cluster can mount at the same path (a "fuse.<name>" type counts too):
# a local-looking run.work_dir on one of them is shared storage.
NETWORK_FILESYSTEMS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "ceph", "glusterfs",
                                 "beegfs", "wekafs", "panfs", "orangefs", "afs", "fuse"})


def filesystem_of(path: str, mounts: str = "/proc/mounts") -> str:
    """The type of the filesystem holding local `path` (the longest mount point above it), "" when the
    mount table cannot be read."""
    if storage.is_remote(path):
        return ""
    target = os.path.realpath(storage.absolute(path).removeprefix("file://"))
    try:
        rows = [line.split()[1:3] for line in Path(mounts).read_text().splitlines() if len(line.split()) > 2]
    except OSError:
        return ""
    best, kind = "", ""
    for point, fstype in rows:
        point = point.replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fstype
    return kind


def shared_by_every_node(path: str, mounts: str = "/proc/mounts") -> bool:
    """An object-store URI, or a local path on a network filesystem."""
    if storage.is_remote(path):
        return True
    return filesystem_of(path, mounts).split(".")[0] in NETWORK_FILESYSTEMS


def check_cluster(cfg: Config, cluster: Cluster, runs: Collection[str], mounts: str = "/proc/mounts") -> None:
    """What the stages in `runs` will ask of the cluster, checked before the first of them starts:
    a ConfigError naming the key when they could wait forever (more workers or actors than the
    cluster can ever place) or lose their output (local storage on several hosts)."""
    if cluster.multi_host:
        _check_shared_storage(cfg, cluster, mounts)
    if "train" in runs:
        _check_train_workers(cfg, cluster)
    if "translate" in runs:
        _check_translate_actors(cfg, cluster)


def check_ray(cfg: Config, runs: Collection[str]) -> None:
    """`check_cluster` on the Ray this driver has reached."""
    check_cluster(cfg, connected_cluster(), runs)


def _check_shared_storage(cfg: Config, cluster: Cluster, mounts: str) -> None:
    hosts = f"the Ray cluster spans {len(cluster.hosts)} host(s) ({', '.join(sorted(cluster.hosts))})"
    if cluster.node_types:
        hosts = "the Ray cluster's autoscaler adds nodes on other hosts"
    for key in ("work_dir", "storage_path"):
        uri = getattr(cfg.run, key)
        if uri and not shared_by_every_node(uri, mounts):
            raise ConfigError(
                f"run.{key} = {uri!r} is on this machine's disk ({filesystem_of(uri, mounts) or 'unknown'} "
                f"filesystem), but {hosts}: workers elsewhere would write checkpoints this driver never reads. "
                f"Set run.{key} to s3://bucket/prefix (or gs://...), or to a path every node mounts (NFS, Lustre, ...)")
    from pipeline.tracking import tracking_uri_for

    uri = tracking_uri_for(cfg) if cfg.tracking.enabled else ""
    # SQLite: one machine's file and lock; a file store: a folder, shared only on a network filesystem.
    if uri.startswith("sqlite:") or (uri.startswith(("/", ".", "file:")) and not shared_by_every_node(uri, mounts)):
        raise ConfigError(
            f"tracking.uri: the runs would go to {uri}, a store on this machine, but {hosts} and the training "
            "and dev BLEU workers log from theirs. Set tracking.uri (or MLFLOW_TRACKING_URI) to an MLflow server, "
            "e.g. http://<head>:5000 (docs/cluster.md), or tracking.enabled = false")


def _check_train_workers(cfg: Config, cluster: Cluster) -> None:
    from pipeline.batch_plan.step_groups import worker_range
    from pipeline.train.dev_bleu_validation import task_resources
    from pipeline.train.driver import cpus_per_worker

    use_gpu = use_gpus(cfg.workers.use_gpu, cluster.most("GPU"), "workers.use_gpu")
    lo = worker_range(cfg)[0]
    cpus = cpus_per_worker(cfg, use_gpu, [n.get("CPU", 0.0) for n in cluster.nodes])
    each = {"CPU": float(cpus), **({"GPU": 1.0} if use_gpu else {})}
    fits = cluster.placeable(each)
    if fits < lo:
        kind = f"GPU worker(s) (1 GPU and {cpus} CPU each)" if use_gpu else f"CPU worker(s) of {cpus} CPU(s) each"
        fix = (f"set --workers.num_workers={fits}; the global batch stays train.tokens_per_step, each worker "
               "accumulating more micro-batches" if fits else "add nodes, or lower workers.cpus_per_worker")
        one_gpu = " (one GPU box: add --config configs/one-gpu.toml)" if use_gpu and fits == 1 else ""
        raise ConfigError(f"workers.num_workers = {cfg.workers.num_workers}: the Ray cluster can never hold {lo} "
                          f"{kind}: it has {cluster.describe()}, and Ray Train would wait for them forever; "
                          f"{fix}{one_gpu}")
    if cfg.dev_bleu.enabled:
        options = task_resources(cfg)[0]
        need = {"CPU": options["num_cpus"], "GPU": options["num_gpus"]}
        if not cluster.placeable(need):
            raise ConfigError(f"dev_bleu.resources = {cfg.dev_bleu.resources!r}: no node of the Ray "
                              f"cluster has that much ({cluster.describe()}), so no checkpoint would get its dev "
                              "BLEU; ask for less, or set dev_bleu.enabled = false")


def _check_translate_actors(cfg: Config, cluster: Cluster) -> None:
    use_gpu = use_gpus(cfg.decode.use_gpu, cluster.most("GPU"), "decode.use_gpu")
    each = {"CPU": cfg.run.data_num_cpus, **({"GPU": 1.0} if use_gpu else {})}
    fits = cluster.placeable(each)
    if fits < cfg.decode.num_workers:
        what = "GPU" if use_gpu else f"{cfg.run.data_num_cpus:g}-CPU"
        raise ConfigError(f"decode.num_workers = {cfg.decode.num_workers}: the Ray cluster can never hold that many "
                          f"{what} translate actors ({cluster.describe()}); set --decode.num_workers={max(1, fits)}")
