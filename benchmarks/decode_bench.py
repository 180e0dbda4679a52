"""Sentences/s of the translate stage (Ray Data, 1..N workers) vs ``beam_search`` in a plain loop.

Both decode the same planned batches (same length-sorted, token-bounded batches, same model,
same beam settings), so the ratio is the cost of Ray Data: actor start-up and model load,
moving batches in and results out. The fair comparison on a CPU box is one torch thread per
worker against a plain loop on one thread: ``ray/plain`` per worker should be >= 0.9 and
the Ray figure should grow near-linearly with workers while workers <= free cores.

The Ray time is the whole ``translate_rows`` call (actors started and models loaded inside
it). A one-sentence probe run measures that fixed start-up, and "steady" figures leave it out
(a real test set decodes for minutes, so start-up is noise there). On a shared, busy box wall
times mostly measure the neighbours, so the actors' own CPU seconds (``TimedTranslator``) are
reported too: ``actor_cpu_vs_plain_cpu`` near 1.0 means Ray adds no per-sentence cost.

    .venv/bin/python benchmarks/decode_bench.py [--num-sentences 300] [--repeats 2] [--workers 1,2] [--out bench.json]

``--engines`` instead compares the decoding engines on one set of weights (a trained tiny model,
or the model of ``--config``) and sentences: our beam search, CTranslate2 float32 and
int8, each in this process on one thread, printing sentences/s and sacreBLEU side by side:

    .venv/bin/python benchmarks/decode_bench.py --engines [--num-sentences 300] [--config configs/local.toml]

``--where`` splits the translate stage's wall time on a trained model (``--config``, its DAG
plan's average + encode outputs; the encoded test split as the stage reads it, ``--threads`` torch
threads): the same planned batches decoded in this process, in a plain Ray actor, and through the
stage's own ``translate_rows`` (Ray Data), rounds alternating; for each, the time until the
translator's constructor runs and the decoding calls' sum:

    .venv/bin/python benchmarks/decode_bench.py --where --config configs/multi30k-fast.toml \
        --config overlay.toml --threads 2 --batch-tokens 4000 --repeats 3

The model is random (it never predicts eos, so every sentence decodes its full a*S+b budget:
a steady, comparable workload); its sizes are small so that a 2-core machine finishes in a
few minutes. Hypotheses of the plain loop and of every Ray run are checked to be identical.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from model import ModelConfig, Transformer, max_source_len  # noqa: E402
from pipeline.config import DecodeSettings  # noqa: E402
from pipeline.decoding import batching, translator  # noqa: E402
from pipeline.evaluate import translate  # noqa: E402
from pipeline.cpu_threads import use_threads  # noqa: E402

log = logging.getLogger("decode_bench")


def make_assets(root: Path, data: Path, num_sentences: int, model_cfg: dict) -> dict:
    """A SentencePiece model, a random model and the encoded newstest2014 head as one Parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import sentencepiece as spm

    lines = []
    for lang in ("en", "de"):
        lines += (data / f"newstest2013.{lang}").read_text(encoding="utf-8").splitlines()[:1500]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(root / "spm"),
                                   vocab_size=2000, model_type="bpe", character_coverage=1.0, pad_id=0,
                                   unk_id=1, bos_id=2, eos_id=3, num_threads=1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(root / "spm.model"))
    cfg = ModelConfig(vocab_size=sp.get_piece_size(), **model_cfg)
    torch.manual_seed(0)
    torch.save(Transformer(cfg).state_dict(), root / "model.pt")
    src = (data / "newstest2014.en").read_text(encoding="utf-8").splitlines()[:num_sentences]
    ids = [sp.encode(s) for s in src]
    (root / "test").mkdir()
    pq.write_table(pa.table({"idx": pa.array(range(len(ids)), pa.int64()),
                             "src_ids": pa.array(ids, pa.list_(pa.int32()))}), root / "test" / "part-0.parquet")
    return {"spm": str(root / "spm.model"), "model": str(root / "model.pt"), "model_config": cfg.to_dict(),
            "split_dir": str(root / "test"), "num_src_tokens": sum(len(i) + 1 for i in ids)}


class TimedTranslator(translator.Translator):
    """Adds the CPU seconds each call spent in this actor (``cpu_s``, on the call's first row)."""

    def __call__(self, batch):
        start = time.process_time()
        out = super().__call__(batch)
        out["cpu_s"] = 0.0
        out.loc[0, "cpu_s"] = time.process_time() - start
        return out


def plain_loop(assets: dict, settings: dict, batch_tokens: int, threads: int) -> tuple[float, dict, float]:
    """Translator in this process over the planned batches: (seconds, idx -> hypothesis, CPU seconds)."""
    use_threads(threads)
    tr = translator.Translator(assets["model"], assets["model_config"], assets["spm"], settings)
    df = batching.read_split(assets["split_dir"], ["idx", "src_ids"])
    max_len = max_source_len(tr.cfg.max_positions, settings["max_len_a"], settings["max_len_b"])
    rows, _ = batching.plan_split("test", df, max_len, tr.cfg.eos_id, batch_tokens)
    start, cpu_start = time.perf_counter(), time.process_time()
    hyps = {}
    for _, group in rows.groupby("batch_id", sort=False):
        out = tr.translate_ids([list(s) for s in group["src_ids"]])
        hyps.update(zip(group["idx"].tolist(), out))
    return time.perf_counter() - start, hyps, time.process_time() - cpu_start


def ray_run(assets: dict, settings: dict, batch_tokens: int, workers: int, actor_cpus: float,
            probe: bool = False) -> tuple[float, dict, float]:
    """translate's Ray Data path (``translate_rows``) with ``workers`` CPU actors; ``probe``
    decodes one short sentence only, which measures the fixed cost (actor start, model load)."""
    df = batching.read_split(assets["split_dir"], ["idx", "src_ids"])
    cfg = ModelConfig.from_dict(assets["model_config"])
    max_len = max_source_len(cfg.max_positions, settings["max_len_a"], settings["max_len_b"])
    rows, _ = batching.plan_split("test", df, max_len, cfg.eos_id, batch_tokens)
    if probe:
        rows = rows.iloc[[-1]]  # the shortest sentence
    kwargs = {"model_path": assets["model"], "model_config": assets["model_config"], "spm_path": assets["spm"],
              "settings": settings, "device": "cpu", "num_threads": max(1, int(actor_cpus))}
    start = time.perf_counter()
    res = translate.translate_rows(rows, kwargs, workers, {"num_cpus": actor_cpus}, TimedTranslator)
    return time.perf_counter() - start, dict(zip(res["idx"].tolist(), res["hyp"])), float(res["cpu_s"].sum())


class ClockedTranslator(translator.Translator):
    """Adds when the constructor started (``t_init``, wall clock) and each call's start and end."""

    def __init__(self, *args, **kwargs):
        self.t_init = time.time()
        super().__init__(*args, **kwargs)

    def __call__(self, batch):
        t0 = time.time()
        out = super().__call__(batch)
        return out.assign(t_init=self.t_init, t0=t0, t1=time.time())


def where_assets(args: argparse.Namespace) -> dict:
    """The trained model of ``--config`` and its encoded test split, planned as the stage plans it."""
    from pipeline.config import load_config
    from pipeline.models import ModelNotFound, finished_stages

    cfg = load_config(args.config, [f"--run.work_dir={args.work_dir}"] if args.work_dir else [])
    try:  # average and every stage it reads (vocab, encode), finished and current
        found = finished_stages(cfg, ["average"], f"--where: config {', '.join(args.config)}")
    except ModelNotFound as e:
        raise SystemExit(str(e)) from None
    avg = found["average"].outputs
    df = batching.read_split(found["encode"].outputs["splits"]["test"]["dir"], ["idx", "src_ids"])
    mcfg = ModelConfig.from_dict(avg["model_config"])
    settings = asdict(DecodeSettings.of(cfg.decode))
    max_len = max_source_len(mcfg.max_positions, settings["max_len_a"], settings["max_len_b"])
    rows, _ = batching.plan_split("test", df, max_len, mcfg.eos_id, args.batch_tokens)
    kwargs = {"model_path": avg["model"], "model_config": avg["model_config"],
              "spm_path": found["vocab"].outputs["model"], "settings": settings, "device": "cpu",
              "num_threads": args.threads}
    return {"rows": rows, "kwargs": kwargs, "settings": settings}


def where_time_goes(args: argparse.Namespace) -> dict:
    """In-process vs plain Ray actor vs the stage's Ray Data path, on the same planned batches."""
    import ray

    from pipeline.ray_env import start_local_ray

    a = where_assets(args)
    rows, kwargs = a["rows"], a["kwargs"]
    blocks = [g.reset_index(drop=True) for _, g in rows.groupby("batch_id", sort=False)]

    def in_process() -> dict:
        start = time.time()
        tr = ClockedTranslator(**kwargs)
        out = [tr(b) for b in blocks]
        return _clocked(start, out)

    @ray.remote(num_cpus=1)
    class Plain:
        def __init__(self):
            self.tr = ClockedTranslator(**kwargs)

        def run(self):
            return [self.tr(b) for b in blocks]

    def plain_actor() -> dict:
        start = time.time()
        actor = Plain.remote()
        out = ray.get(actor.run.remote())
        ray.kill(actor)
        return _clocked(start, out)

    def ray_data() -> dict:
        start = time.time()
        out = translate.translate_rows(rows, kwargs, 1, {"num_cpus": 1}, ClockedTranslator)
        return _clocked(start, [out])

    start_local_ray(num_cpus=args.ray_cpus, log_to_driver=False, configure_logging=False)
    modes = {"in process": in_process, "plain Ray actor": plain_actor, "Ray Data (translate_rows)": ray_data}
    runs: dict = {m: [] for m in modes}
    try:
        for r in range(args.repeats):
            for name, fn in modes.items():
                runs[name].append(fn())
                log.info("round %d, %s: %s", r, name, {k: round(v, 2) for k, v in runs[name][-1].items()})
    finally:
        ray.shutdown()
    summary = {m: {k: statistics.median(x[k] for x in v) for k in v[0]} for m, v in runs.items()}
    return {"settings": a["settings"], "num_sentences": len(rows), "num_batches": len(blocks),
            "threads": args.threads, "runs": runs, "median": summary}


def _clocked(start: float, outs: list) -> dict:
    import pandas as pd

    df = pd.concat(outs, ignore_index=True).groupby("batch_id").first()
    end = time.time()
    return {"total_s": end - start, "to_constructor_s": float(df["t_init"].min()) - start,
            "calls_s": float((df["t1"] - df["t0"]).sum()), "after_last_call_s": end - float(df["t1"].max())}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--where", action="store_true",
                   help="instead: the translate stage's time on a trained model (--config), in process vs "
                        "a plain Ray actor vs Ray Data")
    p.add_argument("--engines", action="store_true",
                   help="instead: ours vs CTranslate2 float32 / int8 (sentences/s, BLEU), same weights")
    p.add_argument("--config", action="append", default=[],
                   help="--engines: the model of this pipeline config (its DAG plan's average + vocab)")
    p.add_argument("--work-dir", default="", help="with --config: instead of its run.work_dir")
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "wmt14"))
    p.add_argument("--num-sentences", type=int, default=300)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workers", default="1,2")
    p.add_argument("--ray-cpus", type=int, default=2, help="CPUs of the local Ray")
    p.add_argument("--actor-cpus", type=float, default=1.0,
                   help="CPUs reserved per actor (torch threads = max(1, int))")
    p.add_argument("--batch-tokens", type=int, default=1000)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--max-len-b", type=int, default=10)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--out", default="")
    p.add_argument("--threads", type=int, default=1, help="--engines: torch / CTranslate2 threads")
    p.add_argument("--alpha", type=float, default=0.6, help="--engines: length penalty")
    p.add_argument("--src-file", default="", help="--engines: source lines (default: newstest2014.en of --data)")
    p.add_argument("--ref-file", default="", help="--engines: reference lines (default: newstest2014.de of --data)")
    p.add_argument("--tokenize", default="13a",
                   help="--engines: sacreBLEU tokenizer ('none' for text already tokenized, e.g. Multi30k's)")
    return p.parse_args()


def alternate_rounds(args: argparse.Namespace, assets: dict, settings: dict, workers: list[int]) -> tuple:
    """``--repeats`` rounds, each the plain loop then, per worker count, the start-up probe and the
    Ray Data run; returns (wall seconds per mode, CPU seconds per mode, whether all hypotheses agree).

    The modes alternate within each round so that a shared, noisy box slows them alike."""
    timings: dict = {"plain": [], **{n: [] for n in workers}, **{("probe", n): [] for n in workers}}
    cpu: dict = {"plain": [], **{n: [] for n in workers}}
    same = True
    for r in range(args.repeats):
        wall, plain_hyps, cpu_s = plain_loop(assets, settings, args.batch_tokens, threads=1)
        timings["plain"].append(wall)
        cpu["plain"].append(cpu_s)
        log.info("round %d: plain loop, 1 thread: %.1f s", r, wall)
        for n in workers:
            timings[("probe", n)].append(ray_run(assets, settings, args.batch_tokens, n, args.actor_cpus,
                                                 probe=True)[0])
            wall, hyps, cpu_s = ray_run(assets, settings, args.batch_tokens, n, args.actor_cpus)
            timings[n].append(wall)
            cpu[n].append(cpu_s)
            same &= hyps == plain_hyps
            log.info("round %d: ray data, %d worker(s): %.1f s (start-up probe %.1f s)", r, n, wall,
                     timings[("probe", n)][-1])
    return timings, cpu, same


def summarize_runs(args: argparse.Namespace, timings: dict, cpu: dict, workers: list[int]) -> list[dict]:
    """One row per mode, from the best round of each (the box is shared): sentences/s, and each Ray
    run against the plain loop, whole and steady (its start-up probe left out)."""
    plain_sps = args.num_sentences / min(timings["plain"])
    runs = [{"mode": "plain loop", "threads": 1, "wall_s": timings["plain"],
             "cpu_s": cpu["plain"], "sentences_per_s": plain_sps}]
    for n in workers:
        wall, startup = min(timings[n]), min(timings[("probe", n)])
        sps = args.num_sentences / wall
        steady = args.num_sentences / (wall - startup) if wall > startup else float("nan")
        runs.append({
            "mode": "ray data", "workers": n, "threads_per_worker": max(1, int(args.actor_cpus)),
            "wall_s": timings[n], "startup_s": timings[("probe", n)], "sentences_per_s": sps,
            "actor_cpu_s": cpu[n], "actor_cpu_vs_plain_cpu": min(cpu[n]) / min(cpu["plain"]),
            "per_worker_vs_plain": sps / n / plain_sps, "steady_sentences_per_s": steady,
            "steady_per_worker_vs_plain": steady / n / plain_sps})
    return runs


def ray_vs_plain(args: argparse.Namespace) -> dict:
    """The default mode: the translate stage's Ray Data path (1..N workers) vs a plain loop, on a
    random model and the newstest2014 head."""
    import ray

    model_cfg = {"d_model": args.d_model, "d_ff": 4 * args.d_model, "n_heads": 4, "n_encoder_layers": args.layers,
                 "n_decoder_layers": args.layers, "max_positions": 512, "dropout": 0.0}
    settings = asdict(DecodeSettings(beam_size=args.beam, max_len_b=args.max_len_b))
    workers = [int(w) for w in args.workers.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        assets = make_assets(Path(tmp), Path(args.data), args.num_sentences, model_cfg)
        ray.init(address="local", num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
        try:
            timings, cpu, same = alternate_rounds(args, assets, settings, workers)
        finally:
            ray.shutdown()
    results: dict = {"settings": settings, "model": model_cfg, "num_sentences": args.num_sentences,
                     "batch_tokens": args.batch_tokens, "runs": summarize_runs(args, timings, cpu, workers),
                     "same_hypotheses": same}
    for run in results["runs"]:
        log.info("%s", {k: (round(v, 2) if isinstance(v, float) else v) for k, v in run.items()})
    log.info("plain loop and every Ray run gave the same hypotheses: %s", same)
    return results


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.where:
        results = where_time_goes(args)
    elif args.engines:
        from decode.engines import compare_engines  # benchmarks/decode/, beside this script

        results = compare_engines(args)
    else:
        results = ray_vs_plain(args)
    print(json.dumps(results, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
