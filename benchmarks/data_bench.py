"""Data-stage benchmark: encode throughput, streaming memory, and a no-op cached rerun.

    python benchmarks/data_bench.py [--mirror DIR] [--scale 10] [--out bench.json]

1. Encode throughput: the Ray Data ``encode`` stage vs a plain single-process loop (pyarrow read ->
   the same SentencePiece model -> the same shard writer) on the same prepared data, in sentence
   pairs/s, side by side; ratio = Ray pairs/s per encode core / plain pairs/s (target >= 0.8).
   Both include reading and writing the shards; the Ray figure also the start of the actor pool
   (a fixed cost, so also given: the rate after the first encoded batch reached the driver).
2. Peak memory of ``prepare`` + ``encode`` on the mirror's training data (1x) and on a custom
   corpus of the same lines repeated ``--scale`` times (target: within 1.3x, i.e. streaming).
   Measured as the peak of the summed PSS (proportional set size: shared pages such as Ray's
   object store are split between the processes that map them, not double-counted) over the
   driver and all its descendants (GCS, raylet, Ray workers), sampled every 0.2 s by psutil. Each
   scale runs in a fresh subprocess with its own local Ray (one at a time). The idle baseline
   (Ray started, nothing running) is given so the growth above it can be read too.
3. No-op rerun: ``workflows/reproduce_base.py --to encode`` a second time, all stages cached.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

log = logging.getLogger("data_bench")


class PeakMemory:
    """Samples PSS over this process tree in a thread: peaks of the sum, the driver, the largest other."""

    def __init__(self, interval_s: float = 0.2):
        import psutil

        self.root, self.interval_s = psutil.Process(), interval_s
        self.peak = self.peak_driver = self.peak_other = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _pss(self) -> list[int]:
        import psutil

        out = []
        for p in [self.root, *self.root.children(recursive=True)]:
            try:
                out.append(p.memory_full_info().pss)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                out.append(0)
        return out

    def sample(self) -> int:
        return sum(self._pss())

    def _loop(self) -> None:
        while not self._stop.is_set():
            pss = self._pss()
            self.peak = max(self.peak, sum(pss))
            self.peak_driver = max(self.peak_driver, pss[0])
            self.peak_other = max(self.peak_other, max(pss[1:], default=0))
            time.sleep(self.interval_s)

    def reset(self) -> None:
        pss = self._pss()
        self.peak, self.peak_driver, self.peak_other = sum(pss), pss[0], max(pss[1:], default=0)

    @property
    def peak_mb(self) -> float:
        return self.peak / 2**20

    def peaks_mb(self) -> dict[str, float]:
        return {"sum": round(self.peak / 2**20, 1), "driver": round(self.peak_driver / 2**20, 1),
                "largest_worker": round(self.peak_other / 2**20, 1)}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def make_corpus(mirror: str, work: Path, scale: int) -> dict[str, list[str] | str]:
    """Extract the mirror once, then write the training pairs repeated ``scale`` times."""
    from pipeline.data import download
    from pipeline.config import Config
    from pipeline.stage import StageContext

    base = work / "extracted"
    if not (base / "done.json").exists():
        cfg = Config()
        cfg.data.mirror, cfg.run.work_dir = mirror, str(work)
        out = download.run(StageContext(name="download", key="x", cfg=cfg, out_dir=str(base), inputs={})).outputs
        (base / "done.json").write_text(json.dumps(out))
    out = json.loads((base / "done.json").read_text())
    files: dict[str, list[str] | str] = {"train_src": [], "train_tgt": []}
    for c in out["train"]:
        for side in ("src", "tgt"):
            dest = work / f"x{scale}" / f"{c['corpus']}.{side}"
            dest.parent.mkdir(parents=True, exist_ok=True)
            data = Path(c[side]).read_bytes()
            dest.write_bytes(data * scale)
            files[f"train_{side}"].append(str(dest))
    files.update(dev_src=out["dev"]["src"], dev_tgt=out["dev"]["tgt"], test_src=out["test"]["src"],
                 test_tgt=out["test"]["tgt"])
    return files


def plain_encode(prepared: dict, model: str, out_dir: Path) -> tuple[int, float]:
    """The baseline: one process, no Ray; same reads, same model, same shard writer."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import sentencepiece as spm

    from pipeline.data.shards import ShardWriter, shard_uris
    from pipeline.data.encode import BATCH_ROWS, SCHEMA, TEXT_SCHEMA, ids_array

    sp = spm.SentencePieceProcessor(model_file=model)
    t0 = time.perf_counter()
    rows = 0
    for split, info in prepared.items():
        schema = SCHEMA if split == "train" else TEXT_SCHEMA
        writer = ShardWriter(str(out_dir / split), info["num_shards"], schema)
        for uri in shard_uris(info["dir"]):
            for batch in pq.ParquetFile(uri).iter_batches(batch_size=BATCH_ROWS, columns=["idx", "src", "tgt"]):
                src_ids, src_len = ids_array(sp.encode(batch.column(1).to_pylist(), out_type=int, num_threads=1))
                tgt_ids, tgt_len = ids_array(sp.encode(batch.column(2).to_pylist(), out_type=int, num_threads=1))
                writer.write(pa.table({"idx": batch.column(0), "src_ids": src_ids, "tgt_ids": tgt_ids,
                                       "src_len": src_len, "tgt_len": tgt_len, "src": batch.column(1),
                                       "tgt": batch.column(2)}))
                rows += batch.num_rows
        writer.close()
    return rows, time.perf_counter() - t0


def _child_config(args: argparse.Namespace, work: Path):
    """The data phase's config for one scale: the custom corpus of ``--files``, 2 shards, a 2000-piece vocab."""
    from pipeline.config import Config

    files = json.loads(Path(args.files).read_text())
    cfg = Config()
    cfg.data.source = "custom"
    for k, v in files.items():
        setattr(cfg.data, k, v)
    cfg.data.num_shards = 2
    cfg.vocab.size, cfg.vocab.sample_sentences = 2000, 200_000
    cfg.run.work_dir = str(work / f"run{args.scale}")
    return cfg


def _run_stage(cfg, res: dict, module, name: str, **inputs):
    """One data stage's ``run`` in this process, its seconds into ``res`` as ``<name>_s``; its manifest."""
    from pipeline.stage import Manifest, StageContext

    out = Path(cfg.run.work_dir) / name
    t0 = time.perf_counter()
    r = module.run(StageContext(name=name, key="k", cfg=cfg, out_dir=str(out), inputs=inputs))
    res[f"{name}_s"] = round(time.perf_counter() - t0, 2)
    return Manifest(stage=name, key="k", dir=str(out), outputs=r.outputs, metrics=r.metrics)


def _prepare_and_vocab(args: argparse.Namespace, cfg, mem: "PeakMemory", res: dict) -> tuple:
    """download, prepare (its peak memory) and vocab (or --vocab-model's); their manifests (prepare, vocab)."""
    from pipeline.data import download
    from pipeline.data import prepare
    from pipeline.data import vocab
    from pipeline.stage import Manifest

    dl = _run_stage(cfg, res, download, "download")
    mem.reset()
    prep = _run_stage(cfg, res, prepare, "prepare", download=dl)
    res["prepare_peak_mb"] = round(mem.peak_mb, 1)
    res["prepare_peaks_mb"] = mem.peaks_mb()
    res["train_pairs"] = prep.outputs["splits"]["train"]["num_rows"]
    if args.vocab_model:
        voc = Manifest(stage="vocab", key="k", dir="",
                       outputs={"model": args.vocab_model, "vocab_size": 2000, "pad_id": 0, "unk_id": 1,
                                          "bos_id": 2, "eos_id": 3})
    else:
        voc = _run_stage(cfg, res, vocab, "vocab", prepare=prep)
    res["vocab_model"] = voc.outputs["model"]
    return prep, voc


def _encode_timed(cfg, mem: "PeakMemory", res: dict, prep, voc) -> int:
    """The encode stage: its peak memory, pairs/s, and its start-up (until the driver got the first
    encoded batch: the actor pool is up) and steady rate; returns the rows encoded."""
    from pipeline.data import encode

    first: list[float] = []  # when the driver got the first encoded batch
    orig = encode.encoded_batches

    def timed(*a, **k):
        for b in orig(*a, **k):
            first.append(first[0] if first else time.perf_counter())
            yield b

    encode.encoded_batches = timed
    mem.reset()
    enc = _run_stage(cfg, res, encode, "encode", prepare=prep, vocab=voc)
    t_last = time.perf_counter()
    res["encode_peak_mb"] = round(mem.peak_mb, 1)
    res["encode_peaks_mb"] = mem.peaks_mb()
    res["prepare_encode_peak_mb"] = max(res["prepare_peak_mb"], res["encode_peak_mb"])
    rows = sum(s["num_rows"] for s in enc.outputs["splits"].values())
    res["encode_rows"] = rows
    res["ray_pairs_per_s"] = round(rows / res["encode_s"], 1)
    res["ray_startup_s"] = round(res["encode_s"] - (t_last - first[0]), 2)
    res["ray_steady_pairs_per_s"] = round(rows / (t_last - first[0]), 1)
    return rows


def child(args: argparse.Namespace) -> dict:
    """One scale, in its own process and its own local Ray."""
    import ray

    work = Path(args.work)
    cfg = _child_config(args, work)
    # address="local": always a fresh local Ray, never another process's cluster on this machine.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    mem = PeakMemory()
    time.sleep(3)
    baseline = mem.sample() / 2**20
    res: dict = {"scale": args.scale, "baseline_mb": round(baseline, 1)}
    prep, voc = _prepare_and_vocab(args, cfg, mem, res)
    rows = _encode_timed(cfg, mem, res, prep, voc)
    mem.stop()
    ray.shutdown()
    n, wall = plain_encode(prep.outputs["splits"], voc.outputs["model"], work / f"plain{args.scale}")
    assert n == rows
    res["plain_pairs_per_s"] = round(n / wall, 1)
    cores = cfg.run.data_concurrency * cfg.run.data_num_cpus
    res["encode_cores"] = cores
    res["ratio_per_core"] = round(res["ray_pairs_per_s"] / cores / res["plain_pairs_per_s"], 3)
    res["ratio_steady_per_core"] = round(res["ray_steady_pairs_per_s"] / cores / res["plain_pairs_per_s"], 3)
    return res


def noop_rerun(mirror: str, work: Path) -> dict:
    """``reproduce_base.py --to encode`` twice on configs/local.toml; the second run is all cached."""
    script = REPO / "workflows" / "reproduce_base.py"
    if not script.exists():
        return {"skipped": "workflows/reproduce_base.py does not exist"}
    cmd = [sys.executable, str(script), "--config", str(REPO / "configs" / "local.toml"), "--to", "encode",
           f"--data.mirror={mirror}", f"--run.work_dir={work / 'dag'}", "--tracking.enabled=false",
           "--run.ray_address=local"]
    out = {}
    for name in ("first_s", "noop_s"):
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        out[name] = round(time.perf_counter() - t0, 2)
        if p.returncode != 0:
            out["error"] = p.stderr[-2000:]
            return out
        out["plan"] = p.stdout.strip().splitlines()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mirror", default=os.environ.get("WMT14_MIRROR", str(REPO.parent / "shared/data/statmt-mirror")))
    p.add_argument("--work", default="/tmp/data_bench")
    p.add_argument("--scale", type=int, default=10)
    p.add_argument("--out", default=None)
    p.add_argument("--skip-noop", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--files", help=argparse.SUPPRESS)
    p.add_argument("--vocab-model", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    work = Path(args.work)
    if args.child:
        print("RESULT " + json.dumps(child(args)))
        return
    work.mkdir(parents=True, exist_ok=True)
    results = {"load_avg_at_start": os.getloadavg(), "cpus": os.cpu_count()}
    vocab_model = ""
    for scale in (1, args.scale):
        files = make_corpus(args.mirror, work, scale)
        fpath = work / f"files{scale}.json"
        fpath.write_text(json.dumps(files))
        cmd = [sys.executable, __file__, "--child", "--scale", str(scale), "--work", str(work), "--files", str(fpath),
               "--vocab-model", vocab_model]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.exit(f"scale {scale} failed:\n{proc.stderr[-4000:]}")
        res = json.loads(lines[-1][len("RESULT "):])
        vocab_model = res["vocab_model"]  # the same model for every scale: same text, same vocab
        results[f"x{scale}"] = res
    one, big = results["x1"], results[f"x{args.scale}"]
    results["peak_ratio"] = round(big["prepare_encode_peak_mb"] / one["prepare_encode_peak_mb"], 3)
    results["growth_above_baseline_mb"] = {
        k: round(results[k]["prepare_encode_peak_mb"] - results[k]["baseline_mb"], 1) for k in ("x1", f"x{args.scale}")}
    if not args.skip_noop:
        results["noop_rerun"] = noop_rerun(args.mirror, work)
    results["load_avg_at_end"] = os.getloadavg()
    _report(results, args.scale)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


def _report(r: dict, scale: int) -> None:
    print(f"{'':28}{'x1':>14}{f'x{scale}':>14}")
    for key, label in (("train_pairs", "train pairs"), ("encode_rows", "encoded rows (all splits)"),
                       ("plain_pairs_per_s", "plain loop pairs/s"), ("ray_pairs_per_s", "Ray encode pairs/s"),
                       ("ratio_per_core", "ratio per core"), ("ray_startup_s", "Ray s to first batch"),
                       ("ray_steady_pairs_per_s", "Ray pairs/s after it"),
                       ("ratio_steady_per_core", "ratio after it, per core"), ("prepare_s", "prepare s"),
                       ("encode_s", "encode s"), ("baseline_mb", "idle Ray PSS MB"),
                       ("prepare_peak_mb", "prepare peak PSS MB"), ("encode_peak_mb", "encode peak PSS MB")):
        print(f"{label:28}{r['x1'][key]:>14}{r[f'x{scale}'][key]:>14}")
    for key in ("prepare_peaks_mb", "encode_peaks_mb"):
        print(f"{key:28}{json.dumps(r['x1'][key])}  x{scale}: {json.dumps(r[f'x{scale}'][key])}")
    print(f"peak ratio x{scale}/x1: {r['peak_ratio']}  (growth above idle: {r['growth_above_baseline_mb']})")
    if "noop_rerun" in r:
        print("no-op rerun:", json.dumps({k: v for k, v in r["noop_rerun"].items() if k != "plan"}))
    print("load average start/end:", r["load_avg_at_start"], r["load_avg_at_end"])


if __name__ == "__main__":
    main()
