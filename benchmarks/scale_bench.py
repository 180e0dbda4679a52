"""Training at the sizes it exists for: per-step host cost, start-up and memory at 4.5M / 36M pairs.

What it does:
1. Writes synthetic encoded shards (the `encode` stage's schema: idx, src_ids, tgt_ids, src_len,
   tgt_len; zstd Parquet, 1M pairs a shard) once per size into --work. Lengths are drawn from the
   joint (EN, DE) length distribution of the real WMT14 EN-DE training text in the offline mirror
   (whitespace words of the Europarl / CommonCrawl-slot / News Commentary samples, 30k pairs),
   times 1.3 pieces per word (what a 37k shared BPE gives on WMT EN-DE, measured on newstest2013
   with this project's vocab stage) -- stated, not fitted on a real encoded corpus. Ids are uniform
   over 1000 pieces (a 37000-piece vocabulary would make the tiny model's output projection of
   25k tokens the cost of the step); real ids compress a little worse, so the Parquet part of the
   first start-up is slightly optimistic. In memory and in the node copy ids are int32 either way.
2. Runs the real train loop (`pipeline.train.loop.Trainer`, in-process session) with a tiny model
   (d_model 16, 1+1 layers) at the paper's 25k target tokens per step, so the model costs almost
   nothing and the host work shows: host ms per step = loop time - forward/backward - optimizer -
   epoch planning - checkpoints, over --steps steps. The timing wraps the loop module's functions,
   so the same script measures another tree (SCALE_BENCH_TREE=<another checkout>) for a before/after table.
3. Start-up (corpus load + first epoch plan) and PSS (/proc/<pid>/smaps_rollup) per worker: one
   worker per size, and --share-workers DDP workers (gloo) on one node at the first size, with
   the corpus's share of PSS summed over the workers vs one copy's bytes (PSS right after the
   training split's load and a read of every page of it, as an epoch does, minus PSS before).
4. Checkpoint bytes vs parameter + Adam-state bytes at base size (vocab 37000), and the loop's
   stall per checkpoint: `save` to a local folder plus, where uploads are synchronous, the copy
   to the storage path (what Ray Train's upload does for a local storage path).

    python benchmarks/scale_bench.py --pairs 4500000,36000000 --json scale.json

Disk: ~0.2 GB of shards per 1M pairs, plus one .npy copy of each size in the node cache
(~0.25 GB per 1M pairs). Memory: one copy of the largest corpus in the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
# SCALE_BENCH_TREE=<another checkout> measures that tree's loop with this script (before/after).
TREE = Path(os.environ.get("SCALE_BENCH_TREE", REPO))
sys.path.insert(0, str(TREE))
VOCAB = 37000  # the base model's vocabulary, for the checkpoint figures
BENCH_VOCAB = 1004  # ids 4..1003 in the synthetic shards and the tiny model
PIECES_PER_WORD = 1.3
PAIRS_PER_SHARD = 1_000_000
MIRROR_MEMBERS = {  # archive -> (en member, de member), the de-en training text of the mirror
    "wmt13/training-parallel-europarl-v7.tgz": ("training/europarl-v7.de-en.en", "training/europarl-v7.de-en.de"),
    "wmt13/training-parallel-commoncrawl.tgz": ("commoncrawl.de-en.en", "commoncrawl.de-en.de"),
    "wmt14/training-parallel-nc-v9.tgz": ("training/news-commentary-v9.de-en.en",
                                          "training/news-commentary-v9.de-en.de"),
}


def pss_mb(pid: int | None = None) -> float:
    for line in Path(f"/proc/{pid or os.getpid()}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# ------------------------------------------------------------------------------ synthetic corpus


def mirror_lengths(mirror: Path) -> np.ndarray:
    """(n, 2) whitespace word counts of the mirror's real EN-DE training pairs (both sides > 0)."""
    pairs = []
    for archive, (en, de) in MIRROR_MEMBERS.items():
        with tarfile.open(mirror / archive) as tar:
            names = {m.name.lstrip("./"): m for m in tar.getmembers()}
            sides = [tar.extractfile(names[m]).read().decode("utf-8", "replace").splitlines() for m in (en, de)]
        pairs += [(len(a.split()), len(b.split())) for a, b in zip(*sides)]
    arr = np.asarray(pairs, dtype=np.int64)
    return arr[(arr[:, 0] > 0) & (arr[:, 1] > 0)]


def write_corpus(out: Path, num_pairs: int, words: np.ndarray, seed: int = 0) -> Path:
    """Encoded shards of `num_pairs` pairs whose lengths follow `words` x PIECES_PER_WORD."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if (out / "DONE").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for k, lo in enumerate(range(0, num_pairs, PAIRS_PER_SHARD)):
        n = min(PAIRS_PER_SHARD, num_pairs - lo)
        pick = words[rng.integers(0, len(words), size=n)]
        lens = np.maximum(1, np.rint(pick * PIECES_PER_WORD * rng.uniform(0.85, 1.15, size=(n, 2)))).astype(np.int32)
        cols = {}
        for j, side in enumerate(("src", "tgt")):
            offsets = np.zeros(n + 1, np.int32)
            np.cumsum(lens[:, j], out=offsets[1:])
            values = rng.integers(4, BENCH_VOCAB, size=int(offsets[-1]), dtype=np.int32)
            cols[f"{side}_ids"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
            cols[f"{side}_len"] = pa.array(lens[:, j])
        table = pa.table({"idx": pa.array(np.arange(lo, lo + n, dtype=np.int64)), "src_ids": cols["src_ids"],
                          "tgt_ids": cols["tgt_ids"], "src_len": cols["src_len"], "tgt_len": cols["tgt_len"]})
        pq.write_table(table, out / f"part-{k:05d}.parquet", compression="zstd", row_group_size=100_000)
    (out / "DONE").write_text(str(num_pairs))
    return out


# ------------------------------------------------------------------------------ one worker (child)


def _time_loop_parts(loop, step_groups) -> dict[str, float]:
    """Wraps the loop's model work, epoch planning and checkpoints in timers; their seconds so far."""
    timers = {"model": 0.0, "plan": 0.0, "checkpoint": 0.0}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                timers[name] += time.perf_counter() - t0
        return wrapper

    loop.accumulate_gradients = timed("model", loop.accumulate_gradients)
    loop.optimizer_step = timed("model", loop.optimizer_step)
    step_groups.plan_epoch = timed("plan", step_groups.plan_epoch)
    loop.Trainer._checkpoint = timed("checkpoint", loop.Trainer._checkpoint)
    return timers


def _measure_corpus_load(loop) -> dict[str, float]:
    """Wraps the loop's corpus loader; the PSS (MB) the training split's load added, as "train"."""
    corpus_pss: dict[str, float] = {}
    loader_name = "load_shared_corpus" if hasattr(loop, "load_shared_corpus") else "load_corpus"
    loader = getattr(loop, loader_name)

    def measured_loader(*a, **kw):  # the training split's load: PSS before, after reading every page
        before = pss_mb()
        corpus = loader(*a, **kw)
        for arr in (corpus.src_values, corpus.src_offsets, corpus.tgt_values, corpus.tgt_offsets):
            int(np.asarray(arr[::1024]).sum())  # one int32 every 4 KiB: each page once, as an epoch does
        corpus_pss.setdefault("train", pss_mb() - before)
        return corpus

    setattr(loop, loader_name, measured_loader)
    return corpus_pss


def _tiny_model_spec(args: argparse.Namespace, loop):
    """The loop's spec: a tiny model (d_model 16, 1+1 layers) at the paper's 25k target tokens per step."""
    from model import ModelConfig
    from pipeline.config import Config

    cfg = Config()
    t = cfg.train
    t.max_steps, t.tokens_per_step, cfg.speed.max_tokens_per_batch = args.steps, 25000, 12500
    cfg.metrics.log_interval_steps = cfg.checkpoint.interval_steps = cfg.metrics.val_loss_interval_steps = args.steps
    if hasattr(t, "corpus_cache_dir"):
        cfg.workers.corpus_cache_dir = args.cache
    mc = ModelConfig(vocab_size=BENCH_VOCAB, d_model=16, d_ff=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1,
                     max_positions=512)
    return loop.LoopSpec(cfg=cfg.to_dict(), model_config=mc.to_dict(), train_dir=args.train_dir)


def child(args: argparse.Namespace) -> None:
    """One worker of the real loop; prints its figures as JSON on the last line."""
    import torch

    from pipeline.batch_plan import step_groups
    from pipeline.train import loop

    torch.set_num_threads(1)
    rank, world = args.rank, args.world
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=world)
    timers = _time_loop_parts(loop, step_groups)
    corpus_pss = _measure_corpus_load(loop)
    spec = _tiny_model_spec(args, loop)
    t0 = time.perf_counter()
    trainer = loop.Trainer(spec, loop.LocalSession(args.ckpt))
    init_s = time.perf_counter() - t0
    pss_corpus = corpus_pss["train"]
    t1 = time.perf_counter()
    summary = trainer.run()
    run_s = time.perf_counter() - t1
    steps = summary["final_step"]
    host_s = run_s - timers["model"] - timers["plan"] - timers["checkpoint"]
    out = {"rank": rank, "steps": steps, "host_ms_per_step": 1000 * host_s / steps,
           "model_ms_per_step": 1000 * timers["model"] / steps, "init_s": init_s, "plan_s": timers["plan"],
           "startup_s": init_s + timers["plan"], "pss_mb": pss_mb(), "pss_corpus_mb": pss_corpus}
    print(json.dumps(out))


def spawn(args, train_dir: Path, world: int, work: Path) -> list[dict]:
    """``world`` child workers on the corpus in ``train_dir``; their JSON figures, by rank."""
    store = work / f"store-{time.time_ns()}"
    procs = []
    for rank in range(world):
        cmd = [sys.executable, __file__, "--child", "--rank", str(rank), "--world", str(world),
               "--store", str(store), "--train-dir", str(train_dir), "--cache", str(work / "node-cache"),
               "--ckpt", str(work / f"ckpt-{world}-{rank}-{time.time_ns()}"), "--steps", str(args.steps)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}))
    results = []
    for p in procs:
        stdout, _ = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"worker failed ({p.returncode})")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return results


# ------------------------------------------------------------------------------ checkpoints


def checkpoint_figures(work: Path) -> dict:
    """At base size (vocab 37000): checkpoint, parameter and Adam-state bytes, the loop's stall per save."""
    import torch

    from model import ModelConfig, Transformer, make_optimizer
    import pipeline.config
    from pipeline.train import checkpoint as train_checkpoint

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    mc = ModelConfig.base(VOCAB)
    model = Transformer(mc)
    opt = make_optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model.logits(model(torch.tensor([[5, 6, 3]]), torch.tensor([[2, 5, 6]]))).sum().backward()
    opt.step()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    adam_bytes = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                     if torch.is_tensor(v) and v.dim() > 0)
    stalls, sizes = [], []
    # A tree without background checkpoint uploads has neither checkpoint.upload nor train.checkpoint_upload.
    # (The sections were named CheckpointConfig and TrainConfig before CheckpointSection, TrainSection.)
    upload_async = any(hasattr(getattr(pipeline.config, name, None), attr) for name, attr in (
        ("CheckpointSection", "upload"), ("CheckpointConfig", "upload"), ("TrainConfig", "checkpoint_upload")))
    for i in range(2):
        folder, dest = work / f"ckpt-base-{i}", work / f"ckpt-base-{i}-uploaded"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(dest, ignore_errors=True)
        folder.mkdir()
        t0 = time.perf_counter()
        train_checkpoint.save(folder, model=model, optimizer=opt, scheduler=sched, scaler=None,
                              progress=train_checkpoint.Progress(), model_config=mc.to_dict())
        if not upload_async:  # a loop without checkpoint_upload waits for Ray Train's synchronous copy
            shutil.copytree(folder, dest)
        stalls.append(time.perf_counter() - t0)
        sizes.append(sum(f.stat().st_size for f in folder.iterdir()))
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(dest, ignore_errors=True)
    return {"checkpoint_bytes": sizes[-1], "param_bytes": param_bytes, "adam_state_bytes": adam_bytes,
            "checkpoint_stall_s": min(stalls), "upload": "async (background)" if upload_async else "sync"}


# ------------------------------------------------------------------------------ main


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", default="4500000,36000000")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--share-workers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="warm single-worker runs per size; the best is kept")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "scale-bench"))
    ap.add_argument("--mirror", default=os.environ.get("WMT14_MIRROR", str(REPO.parent / "shared/data/statmt-mirror")))
    ap.add_argument("--json")
    ap.add_argument("--no-checkpoint", action="store_true")
    ap.add_argument("--prepare-only", action="store_true", help="write the synthetic shards and stop")
    ap.add_argument("--single-run", action="store_true", help="one worker run per size (no second, warm start)")
    ap.add_argument("--child", action="store_true")
    for name in ("--rank", "--world", "--store", "--train-dir", "--cache", "--ckpt"):
        ap.add_argument(name, type=int if name in ("--rank", "--world") else str)
    return ap.parse_args()


def one_worker(args: argparse.Namespace, d: Path, work: Path, key: str, res: dict) -> None:
    """A cold start (no node copy yet) and the best warm one of the corpus in ``d``, into ``res``."""
    shutil.rmtree(work / "node-cache", ignore_errors=True)  # a cold node: no copy yet
    cold = spawn(args, d, 1, work)[0]  # the first worker on the node (writes the node copy, if any)
    # A later or replaced worker (maps the copy): the best of --repeats runs (a shared VM is noisy).
    warm = cold if args.single_run else min((spawn(args, d, 1, work)[0] for _ in range(args.repeats)),
                                            key=lambda r: r["host_ms_per_step"])
    res["host_ms_per_step"][key] = warm["host_ms_per_step"]
    res["startup_s"][key], res["startup_warm_s"][key] = cold["startup_s"], warm["startup_s"]
    res["pss_mb_per_worker"][key] = warm["pss_mb"]
    print(f"  1 worker: host {warm['host_ms_per_step']:.2f} ms/step (model {warm['model_ms_per_step']:.1f}), "
          f"start-up {cold['startup_s']:.1f} s first / {warm['startup_s']:.1f} s next, PSS {warm['pss_mb']:.0f} MB",
          flush=True)


def shared_workers(args: argparse.Namespace, d: Path, work: Path, key: str, res: dict) -> None:
    """--share-workers DDP workers on one node: their PSS, and the corpus's share vs one copy, into ``res``."""
    shared = spawn(args, d, args.share_workers, work)
    res["pss_mb_all_workers"][key] = sum(r["pss_mb"] for r in shared)
    res["pss_corpus_mb_all_workers"][key] = sum(r["pss_corpus_mb"] for r in shared)
    copy_mb = _corpus_bytes(d) / 2**20
    res["corpus_bytes"][key] = _corpus_bytes(d)
    print(f"  {args.share_workers} DDP workers: PSS {res['pss_mb_all_workers'][key]:.0f} MB in all, of it the "
          f"corpus {res['pss_corpus_mb_all_workers'][key]:.0f} MB = "
          f"{res['pss_corpus_mb_all_workers'][key] / copy_mb:.2f}x one copy ({copy_mb:.0f} MB)", flush=True)


def checkpoint_report(work: Path, res: dict) -> None:
    """checkpoint_figures into ``res``, printed against the parameter + Adam bytes."""
    ck = checkpoint_figures(work)
    res.update(ck)
    total = ck["param_bytes"] + ck["adam_state_bytes"]
    print(f"checkpoint at base size: {ck['checkpoint_bytes'] / 2**20:.0f} MiB = {ck['checkpoint_bytes'] / total:.3f}x "
          f"(params {ck['param_bytes'] / 2**20:.0f} + Adam {ck['adam_state_bytes'] / 2**20:.0f} MiB); "
          f"loop stall {ck['checkpoint_stall_s']:.2f} s ({ck['upload']} upload)")


def main() -> None:
    args = parse_args()
    if args.child:
        return child(args)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    sizes = [int(x) for x in args.pairs.split(",")]
    words = mirror_lengths(Path(args.mirror))
    res: dict = {k: {} for k in ("host_ms_per_step", "startup_s", "startup_warm_s", "pss_mb_per_worker",
                                 "pss_mb_all_workers", "pss_corpus_mb_all_workers", "corpus_bytes")}
    print(f"lengths: {len(words)} real EN-DE pairs from the mirror, mean {words.mean(0) * PIECES_PER_WORD} pieces")
    for n in sizes:
        t0 = time.perf_counter()
        d = write_corpus(work / f"corpus-{n}", n, words)
        print(f"{n:>10,} pairs: shards ready in {time.perf_counter() - t0:.0f} s "
              f"({sum(f.stat().st_size for f in d.glob('*.parquet')) / 2**30:.2f} GiB)", flush=True)
        if args.prepare_only:
            continue
        one_worker(args, d, work, str(n), res)
        if n == sizes[0] and args.share_workers > 1:
            shared_workers(args, d, work, str(n), res)
    if args.prepare_only:
        return
    print(f"tree: {TREE}")
    if len(sizes) > 1:
        a, b = (res["host_ms_per_step"][str(s)] for s in (sizes[0], sizes[-1]))
        print(f"host ms/step {sizes[-1]:,} / {sizes[0]:,}: {b / a:.2f}x")
    if not args.no_checkpoint:
        checkpoint_report(work, res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")


def _corpus_bytes(d: Path) -> int:
    """Bytes of one in-memory copy: int32 values + int64 offsets of both sides."""
    import pyarrow.parquet as pq

    n = pieces = 0
    for f in sorted(d.glob("*.parquet")):
        md = pq.read_table(f, columns=["src_len", "tgt_len"])
        n += md.num_rows
        pieces += int(np.asarray(md.column("src_len")).sum() + np.asarray(md.column("tgt_len")).sum())
    return pieces * 4 + 2 * (n + 1) * 8


if __name__ == "__main__":
    main()
