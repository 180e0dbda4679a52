"""What a node loss, a preemption notice and a tracking outage cost a training run.

1. Two Ray nodes on this machine (one CPU each, tests/support/procs.py), the real `train` stage with
   `workers.num_workers = [1, 2]` on the scale bench's synthetic corpus (benchmarks/scale_bench.py:
   WMT14 EN-DE length distribution, 1000-piece ids). Once Ray Train has registered checkpoint 10
   the second node's processes are killed (SIGKILL to its raylet's session): the time from the
   kill to the first step of the one-worker group, and the steps lost (done after the checkpoint
   it resumes from, so replayed). Then a SIGTERM to the remaining worker, a few steps after the
   resume: the steps lost (the run resumes from the checkpoint the notice wrote) and the time to
   the next step. Every step is stamped by a session wrapper here (`stamp`: time, step, world
   size, pid), installed as the tests install theirs.
2. The loop (in-process, `LocalSession`) logging every 2 steps to an MLflow server that is stopped
   for --outage-s, with MLflow's HTTP retries shortened to 4 retries, backoff factor 1 (1+2+4+8 s;
   the defaults, 7 and 2, wait up to ~4 min): the longest step and the steps done while the server
   is away, with the synchronous `RunLogger` (the loop's logger before 1ae1c38) and with
   `BufferedRunLogger` (now).

    python benchmarks/elastic_bench.py --json elastic.json

Model: --d-model 256, 3+3 layers, --tokens-per-step 600 by default (minutes on 2 CPU cores); base
size (its checkpoint, ~0.75 GB with Adam's moments, is what a restart loads) with
`--d-model 512 --layers 6 --vocab 37000`. What the figures are made of (Ray's detection and
restart, a checkpoint's load, MLflow's retries) is stated next to them in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DRIVER = r"""
import json, sys
import ray
from pipeline.train import driver as train
from pipeline.config import load_config
from pipeline.stage import Manifest, StageContext

overrides, out_dir, shards, repo, run, vocab_size = json.loads(sys.argv[1]), *sys.argv[2:6], int(sys.argv[6])
cfg = load_config(None, overrides)
ray.init(address=cfg.run.ray_address, runtime_env={"env_vars": {"PYTHONPATH": repo}}, log_to_driver=False)
vocab = {"vocab_size": vocab_size, "pad_id": 0, "unk_id": 1, "bos_id": 2, "eos_id": 3}
inputs = {"encode": Manifest(stage="encode", key="k", dir="", outputs={"splits": {"train": {"dir": shards}}}),
          "vocab": Manifest(stage="vocab", key="k", dir="", outputs=vocab)}
print("RESULT " + json.dumps(train.run(StageContext(name="train", key=run, cfg=cfg, out_dir=out_dir, inputs=inputs)).outputs))
"""


# ------------------------------------------------------------------ the session wrapper (workers)


def stamp(session: Any, path: str) -> Any:
    """Rank 0 appends `time step world pid` before each step to `path`."""

    class Stamped:
        def __init__(self, inner: Any):
            self.inner, self.rank, self.world_size, self.device = inner, inner.rank, inner.world_size, inner.device

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def before_step(self, step: int) -> None:
            if self.inner.before_step is not None:
                self.inner.before_step(step)
            if self.rank == 0:
                with open(path, "a") as f:
                    f.write(f"{time.time():.3f} {step} {self.world_size} {os.getpid()}\n")

    return Stamped(session)


def read_stamps(path: Path) -> list[tuple[float, int, int, int]]:
    if not path.exists():
        return []
    rows = [line.split() for line in path.read_text().splitlines()]
    return [(float(t), int(s), int(w), int(p)) for t, s, w, p in (r for r in rows if len(r) == 4)]


def registered_step(run_dir: Path) -> int:
    import re

    try:
        snap = (run_dir / "checkpoint_manager_snapshot.json").read_text()
        latest = json.dumps(json.loads(snap).get("latest_checkpoint_result"))
    except (FileNotFoundError, json.JSONDecodeError):
        return 0
    return max(map(int, re.findall(r"checkpoint_(\d+)", latest)), default=0)


# ------------------------------------------------------------------ 1. node loss and SIGTERM


def model_args(a: argparse.Namespace) -> list[str]:
    return [f"--model.d_model={a.d_model}", f"--model.d_ff={4 * a.d_model}", f"--model.n_heads={a.d_model // 64}",
            f"--model.n_encoder_layers={a.layers}", f"--model.n_decoder_layers={a.layers}",
            "--model.max_positions=256", "--train.max_len=200", f"--train.tokens_per_step={a.tokens_per_step}",
            f"--speed.max_tokens_per_batch={max(a.tokens_per_step, 1600)}", "--train.warmup_steps=100",
            "--speed.precision=fp32"]


def start_driver(a: argparse.Namespace, shards: Path, work: Path, address: str, stamps: Path, run: str
                 ) -> subprocess.Popen:
    """The `train` stage's driver (`DRIVER`) on the cluster at `address`, a range of 1-2 workers,
    every step stamped into `stamps`; its log in work/driver.log."""
    overrides = [f"--run.ray_address={address}", f"--run.work_dir={work / 'wd'}", "--workers.num_workers=1,2",
                 "--workers.cpus_per_worker=1", "--workers.use_gpu=false", "--speed.precision=fp32",
                 f"--train.max_steps={a.max_steps}", "--checkpoint.interval_steps=10",
                 "--metrics.log_interval_steps=10", "--metrics.val_loss_interval_steps=100000",
                 "--workers.max_failures=5", "--workers.elastic_resize_interval_s=600", *model_args(a)]
    env = {**os.environ, "TRANSFORMER_REPRO_SESSION_WRAPPER": f"benchmarks.elastic_bench:stamp:{stamps}",
           "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(overrides), str(work / "wd/train" / run),
                             str(shards), str(REPO), run, str(a.vocab)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=open(work / "driver.log", "w"), text=True)


def median_step_s(steps: list[tuple[float, int, int, int]], world: int) -> float:
    """The median time between consecutive steps that a group of `world` workers both ran."""
    gaps = sorted(b[0] - a[0] for a, b in zip(steps, steps[1:]) if a[2] == b[2] == world and b[1] == a[1] + 1)
    return gaps[len(gaps) // 2]


def cluster_part(a: argparse.Namespace, shards: Path, work: Path) -> dict[str, Any]:
    from tests.support.procs import RayHead, stop, wait_for

    stamps, run = work / "stamps.txt", "elastic-bench"
    # As tests/integration/test_cluster_train.py: `ray start` turns token auth on once ~/.ray/auth_token exists.
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)})
    head = RayHead(work, num_cpus=1, resources='{"node_a": 1}')
    nodes = [head.add_worker(num_cpus=1, resources='{"node_b": 1}', name="worker-b")]
    driver = start_driver(a, shards, work, head.address, stamps, run)
    run_dir = work / "wd/ray_train" / run

    def wait(what: str, cond: Any) -> None:
        wait_for(what, cond, driver, work / "driver.log", timeout_s=600)

    try:
        # A node lost after checkpoint 10: the one-worker group resumes from its latest checkpoint.
        wait("checkpoint 10", lambda: registered_step(run_dir) >= 10)
        before = read_stamps(stamps)
        t_kill = time.time()
        stop(nodes[0], timeout_s=0)
        wait("a step on one worker", lambda: any(w == 1 for _, _, w, _ in read_stamps(stamps)))
        small = [r for r in read_stamps(stamps) if r[2] == 1]
        resumed = small[0][1] - 1
        done_before = max(s for t, s, _, _ in before + [r for r in read_stamps(stamps) if r[0] < t_kill]) - 1
        # A SIGTERM to the remaining worker a few steps later: it checkpoints the step it is in.
        wait("3 steps on one worker", lambda: read_stamps(stamps)[-1][1] >= resumed + 4)
        last = read_stamps(stamps)[-1]
        t_term = time.time()
        os.kill(last[3], signal.SIGTERM)
        wait("a step after the SIGTERM restart",
             lambda: any(p != last[3] for _, _, _, p in read_stamps(stamps)[-3:]))
        after = next(r for r in read_stamps(stamps) if r[3] != last[3] and r[0] > t_term)
        signalled_step = max(s for t, s, _, p in read_stamps(stamps) if p == last[3] and t <= t_term)
        out, _ = driver.communicate(timeout=900)
        if driver.returncode != 0:
            raise RuntimeError((work / "driver.log").read_text()[-3000:])
    finally:
        if driver.poll() is None:
            driver.kill()
        for n in nodes:
            stop(n, timeout_s=5)
        stop(head.proc, timeout_s=5)
    steps = read_stamps(stamps)
    return {"step_s_2_workers": median_step_s(steps, 2), "step_s_1_worker": median_step_s(steps, 1),
            "node_loss_to_first_step_s": small[0][0] - t_kill, "node_loss_resumed_from": resumed,
            "node_loss_steps_done_before": done_before, "node_loss_steps_lost": done_before - resumed,
            "sigterm_during_step": signalled_step, "sigterm_resumed_from": after[1] - 1,
            "sigterm_steps_lost": signalled_step - (after[1] - 1), "sigterm_to_next_step_s": after[0] - t_term,
            "final_step": json.loads(out.split("RESULT ", 1)[1])["final_step"]}


# ------------------------------------------------------------------ 2. tracking outage


def outage_part(a: argparse.Namespace, shards: Path, work: Path, buffered: bool) -> dict[str, Any]:
    from mlflow import MlflowClient

    from model import ModelConfig
    from pipeline import tracking
    from pipeline.config import load_config
    from pipeline.train import metrics
    from pipeline.train.loop import LocalSession, LoopSpec, Trainer
    from pipeline.cpu_threads import use_threads
    from tests.support.mlflow_server import MlflowServer

    os.environ.update({"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "4", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                       "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"})
    use_threads(2)
    cfg = load_config(None, [f"--train.max_steps={10**6}", "--metrics.log_interval_steps=2",
                             "--checkpoint.interval_steps=1000000", "--metrics.val_loss_interval_steps=1000000",
                             *model_args(a)])
    mc = ModelConfig(vocab_size=a.vocab, d_model=a.d_model, d_ff=4 * a.d_model, n_heads=a.d_model // 64,
                     n_encoder_layers=a.layers, n_decoder_layers=a.layers, max_positions=256)
    server = MlflowServer(work / ("mlflow-buffered" if buffered else "mlflow-sync"))
    original = metrics._make_tracker
    if not buffered:  # the loop's logger before 1ae1c38: each log step waits for the server
        class SyncLogger(tracking.RunLogger):
            def close(self) -> None:  # nothing buffered
                pass

        metrics._make_tracker = lambda uri, run_id, buffer_s, spool_dir=None: SyncLogger(uri, run_id)
    try:
        client = MlflowClient(server.uri)
        run_id = client.create_run(client.create_experiment("outage")).info.run_id
        spec = LoopSpec(cfg=cfg.to_dict(), model_config=mc.to_dict(), train_dir=str(shards), tracking_uri=server.uri,
                        run_id=run_id)
        trainer = Trainer(spec, LocalSession(work / ("ck-b" if buffered else "ck-s")))
        times: list[tuple[float, int]] = []
        inner = trainer.session.before_step

        def stamped(step: int) -> None:
            times.append((time.time(), step))
            if inner is not None:
                inner(step)

        trainer.session.before_step = stamped
        th = threading.Thread(target=trainer.run, daemon=True)
        th.start()
        while trainer.progress.step < 20:
            time.sleep(0.05)
        t0 = time.time()
        server.stop(timeout_s=0)
        time.sleep(a.outage_s)
        t1 = time.time()
        server.start()
        time.sleep(5)
        trainer.tc.max_steps = trainer.progress.step + 2 - trainer.progress.step % 2
        th.join(timeout=600)
    finally:
        metrics._make_tracker = original
        server.stop()
    return {"logger": "BufferedRunLogger" if buffered else "RunLogger (sync)", **outage_figures(times, t0, t1)}


def outage_figures(times: list[tuple[float, int]], t0: float, t1: float) -> dict[str, float]:
    """The steps' durations around an outage from t0 to t1, from each step's (start time, step)."""
    gaps = [(b[0] - x[0], x[0]) for x, b in zip(times, times[1:])]
    before = sorted(g for g, t in gaps if t < t0)
    usual = before[len(before) // 2]  # the median step before the outage
    during = [g for g, t in gaps if t0 <= t < t1]
    return {"usual_step_s": usual, "longest_step_in_outage_s": max(during) if during else t1 - t0,
            "steps_in_outage": len(during), "steps_expected": (t1 - t0) / usual, "outage_s": t1 - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=50_000)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=1004,
                    help="the model's vocabulary (the corpus uses ids < 1004); base: 37000")
    ap.add_argument("--tokens-per-step", type=int, default=600)
    ap.add_argument("--max-steps", type=int, default=60)
    ap.add_argument("--outage-s", type=float, default=25.0)
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "elastic-bench"))
    ap.add_argument("--mirror", default=os.environ.get("WMT14_MIRROR", str(REPO.parent / "shared/data/statmt-mirror")))
    ap.add_argument("--parts", default="cluster,outage")
    ap.add_argument("--json")
    a = ap.parse_args()
    sys.path.insert(0, str(REPO / "benchmarks"))
    import scale_bench

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    shards = scale_bench.write_corpus(work / f"corpus-{a.pairs}", a.pairs, scale_bench.mirror_lengths(Path(a.mirror)))
    result: dict[str, Any] = {"model": {"d_model": a.d_model, "layers": a.layers, "vocab": a.vocab,
                                        "tokens_per_step": a.tokens_per_step}}
    if "cluster" in a.parts:
        result["cluster"] = cluster_part(a, shards, Path(tempfile.mkdtemp(dir=work, prefix="cluster-")))
        print(json.dumps(result["cluster"], indent=1), flush=True)
    if "outage" in a.parts:
        result["outage"] = [outage_part(a, shards, Path(tempfile.mkdtemp(dir=work, prefix="outage-")), b)
                            for b in (False, True)]
        print(json.dumps(result["outage"], indent=1), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
