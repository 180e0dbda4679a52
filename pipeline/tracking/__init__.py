"""The only package that talks to MLflow's runs (``pipeline/registry.py`` holds the Model Registry).

One parent run per workflow invocation; one run per (stage, cache key), continued when a crashed
stage reruns (see `Tracking`), and a small nested run for each stage served from cache. A sweep
(workflows/reproduce_table3.py) nests one parent per row in its own run: sweep -> row -> stages.
Embedded default: a SQLite store under the work dir (MLflow's file store is in maintenance mode
in 3.x) with artifacts beside it; ``tracking.uri`` / ``MLFLOW_TRACKING_URI`` name a server.
Ray workers log through ``RunLogger`` (picklable: a URI and a run id); the training loop's
metrics go through ``BufferedRunLogger``, whose thread does the waiting when the server is away;
what it still holds when training ends goes to a ``MetricSpool`` beside the checkpoints, which the
driver (``deliver_spool``: the train stage, the next invocation's start) delivers.
The driver's calls wait at most ``tracking.timeout_s`` for a server (``TrackingUnavailable``).

One job per module, imported in this order (each only from those before it):
``uri`` (which store; is the server up), ``client`` (a client whose calls give up in time),
``loggers`` (``RunLogger``), ``spool`` (``MetricSpool``, ``deliver_spool``), ``buffered``
(``BufferedRunLogger`` and its ``MetricQueue``), ``runs`` (``Tracking``: the run lifecycle,
``end_dead_runs``; ``WorkDirRuns``: this work dir's runs in the experiment).
Imports the pipeline core (storage, config) only; MLflow is imported lazily, on first use.
"""

from pipeline.tracking.buffered import BufferedRunLogger
from pipeline.tracking.client import BoundedClient, TrackingUnavailable
from pipeline.tracking.loggers import DROPPED_TAG, RunLogger, flatten
from pipeline.tracking.runs import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, Tracking, git_commit
from pipeline.tracking.spool import SPOOL_FOLDER, MetricSpool, Point, deliver_spool, spool_dir_for, spooled_run_ids
from pipeline.tracking.uri import artifact_location_for, check_reachable, tracking_uri_for

__all__ = [
    "BoundedClient", "BufferedRunLogger", "DROPPED_TAG", "EXPERIMENT_KIND", "EXPERIMENT_KIND_TAG", "MetricSpool",
    "Point", "RunLogger", "SPOOL_FOLDER", "Tracking", "TrackingUnavailable", "artifact_location_for",
    "check_reachable", "deliver_spool", "flatten", "git_commit", "spool_dir_for", "spooled_run_ids",
    "tracking_uri_for",
]
