"""Dev BLEU per registered checkpoint, off the training devices: Ray Train's asynchronous validation.

The train stage gives its `TorchTrainer` a ``ValidationConfig(fn=validate_checkpoint, ...)``
(``validation_config``) and rank 0 reports each checkpoint with ``validation=True``. Ray Train
2.60 then, once the checkpoint is registered (its upload complete), runs ``validate_checkpoint``
in a Ray task of its own (``eval.dev_bleu_resources``: a CPU by default, a GPU if given), at most
one at a time (``MAX_IN_FLIGHT_VALIDATIONS = 1`` in its ValidationManager), while the workers train
on: ``ray.train.report`` does not wait for it. The returned metrics are merged into the
checkpoint's metrics in Ray's checkpoint-manager snapshot; a task that raises is logged by Ray
(``VALIDATION_FAILED``) and never fails the run; the run's end waits for the queued ones.

What one validation does (``score_checkpoint``): the dev split (newstest2013 for WMT14, the custom
dev set otherwise; ``eval.dev_bleu_sentences`` caps it) decoded with CTranslate2 (the checkpoint
converted in the task with ``pipeline.serve.export``, ``eval.dev_bleu_quantization``), greedy or
beam (``eval.dev_bleu_beam_size``, 0 = ``eval.beam_size``; alpha and max length from ``eval``),
then sacreBLEU, chrF and the paper's tokenized BLEU (``score.score_split``). A Table 3 variant that
Marian cannot hold (``export.unexportable``) is decoded with our beam search instead, and says so.
Results go to the train stage's MLflow run at the checkpoint's step (``dev/bleu_sacre``,
``dev/chrf``, ``dev/bleu_tok_cs`` or ``dev/bleu_tok``, ``dev/bleu_time_s``) through
``RunLogger.log_metrics``, which logs a step only above the last one the run holds: after a
resume the curve continues without duplicates.

Backlog: Ray queues every reported checkpoint and starts the next validation when one ends. A
task whose checkpoint is no longer the newest registered one (Ray's snapshot names a later one)
skips it, so a backlog drains to the newest checkpoint; skips are recorded and counted.

Each task writes a record, ``<Ray Train run dir>/dev_bleu/<checkpoint>.json`` (status validated |
skipped | failed, scores, settings, seconds): the train stage sums them up, ``average`` reads them
to select by dev BLEU, ``score``'s report lists them. Records outlive Ray's checkpoint rotation.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.ray_env import worker_logging
from pipeline import storage
from pipeline.config import Config, parse_resources

log = logging.getLogger(__name__)

RECORDS = "dev_bleu"  # folder of per-checkpoint records in the Ray Train run dir
SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train V2's (as pipeline.train.resume)


@dataclass(frozen=True)
class DevBleuSettings:
    """What decides a dev BLEU number (recorded with it; `average` keys on these)."""

    sentences: int  # 0 = all
    engine: str  # "ctranslate2" | "torch"
    quantization: str  # CTranslate2 weights: "int8" | "float32"
    beam_size: int
    alpha: float
    max_len_a: float
    max_len_b: int

    @classmethod
    def from_config(cls, cfg: Config) -> "DevBleuSettings":
        ev = cfg.eval
        return cls(ev.dev_bleu_sentences, ev.dev_bleu_engine, ev.dev_bleu_quantization,
                   ev.dev_bleu_beam_size or ev.beam_size, ev.alpha, ev.max_len_a, ev.max_len_b)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def task_resources(cfg: Config) -> tuple[dict[str, Any], str, int]:
    """(ray.remote options, device, decoding threads) of the validation task."""
    res = parse_resources(cfg.eval.dev_bleu_resources, "eval.dev_bleu_resources")
    cpus, gpus = res.pop("CPU", 1.0), res.pop("GPU", 0.0)
    options: dict[str, Any] = {"num_cpus": cpus, "num_gpus": gpus, "max_retries": 0}
    if res:
        options["resources"] = res
    return options, "cuda" if gpus > 0 else "cpu", max(1, int(cpus))


def reserved_cpus(cfg: Config) -> float:
    """CPUs the validation task reserves on a node (train's auto CPU share leaves them free)."""
    return task_resources(cfg)[0]["num_cpus"] if cfg.eval.dev_bleu else 0.0


def unavailable(cfg: Config, dev_dir: str, vocab: dict[str, Any]) -> str | None:
    """Why this train run gets no dev BLEU (None: it does)."""
    if not cfg.eval.dev_bleu:
        return "eval.dev_bleu = false"
    if not dev_dir:
        return "the encode stage has no dev split"
    if not vocab.get("model"):
        return "the vocab stage names no SentencePiece model"
    return None


def validation_config(cfg: Config, *, dev_dir: str, vocab: dict[str, Any], run_dir: str,
                      tracking_uri: str | None, run_id: str | None) -> Any | None:
    """The `TorchTrainer`'s ``validation_config``, or None (logged why) when there is no dev BLEU."""
    why = unavailable(cfg, dev_dir, vocab)
    if why:
        log.info("train: no dev BLEU per checkpoint (%s)", why)
        return None
    from ray.train import ValidationConfig, ValidationTaskConfig

    options, device, threads = task_resources(cfg)
    kwargs = {"run_dir": storage.absolute(run_dir), "dev_dir": storage.absolute(dev_dir),
              "spm": storage.absolute(vocab["model"]), "settings": DevBleuSettings.from_config(cfg).to_dict(),
              "tgt_lang": cfg.data.tgt_lang, "preprocess": cfg.data.preprocess, "device": device, "threads": threads,
              "batch_tokens": cfg.eval.batch_tokens, "tracking_uri": tracking_uri, "run_id": run_id}
    log.info("train: dev BLEU per checkpoint in a Ray task (%s), %s", options, kwargs["settings"])
    return ValidationConfig(fn=validate_checkpoint, task_config=ValidationTaskConfig(fn_kwargs=kwargs),
                            ray_remote_kwargs=options)


# ----------------------------------------------------------------------------- the Ray task


def validate_checkpoint(checkpoint: Any, *, run_dir: str, dev_dir: str, spm: str, settings: dict[str, Any],
                        tgt_lang: str, device: str, threads: int, batch_tokens: int,
                        tracking_uri: str | None, run_id: str | None, preprocess: str = "none") -> dict[str, float]:
    """Ray Train's validation function: ``checkpoint`` (a registered ``ray.train.Checkpoint``) first,
    the ``fn_kwargs`` above; returns the metrics Ray merges into the checkpoint's."""
    worker_logging()
    name = Path(checkpoint.path).name
    step = step_of(name)
    newest = newest_registered_step(run_dir)
    base = {"checkpoint": name, "step": step, "settings": settings, "started_unix": time.time()}
    if newest > step:
        log.info("dev BLEU: skipping %s (step %d): checkpoint at step %d is newer", name, step, newest)
        write_record(run_dir, {**base, "status": "skipped", "newer_step": newest})
        return {}
    t0 = time.perf_counter()
    try:
        with checkpoint.as_directory() as local:
            result = score_checkpoint(local, dev_dir, spm, DevBleuSettings(**settings), tgt_lang, device,
                                      threads, batch_tokens, preprocess)
    except Exception as e:
        write_record(run_dir, {**base, "status": "failed", "error": f"{type(e).__name__}: {e}",
                               "seconds": time.perf_counter() - t0})
        log.exception("dev BLEU: %s failed (training goes on)", name)
        raise
    result["seconds"] = time.perf_counter() - t0
    write_record(run_dir, {**base, "status": "validated", **result})
    metrics = metrics_of(result)
    _log_to_run(tracking_uri, run_id, {**metrics, "dev/bleu_time_s": result["seconds"]}, step)
    log.info("dev BLEU: %s (step %d): sacreBLEU %.2f, chrF %.2f on %d sentences (%s) in %.1f s", name, step,
             result["bleu_sacre"], result["chrf"], result["num_sentences"], result["engine"], result["seconds"])
    return metrics


def metrics_of(result: dict[str, Any]) -> dict[str, float]:
    key = result["tok_metric"]
    return {"dev/bleu_sacre": result["bleu_sacre"], "dev/chrf": result["chrf"], f"dev/{key}": result[key]}


def score_checkpoint(folder: str, dev_dir: str, spm: str, settings: DevBleuSettings, tgt_lang: str,
                     device: str = "cpu", threads: int = 1, batch_tokens: int = 4000,
                     preprocess: str = "none") -> dict[str, Any]:
    """Decode the dev split with the checkpoint in ``folder`` (model.pt + meta.json) and score it."""
    from pipeline.evaluate.bleu import paper_metric
    from pipeline.evaluate.score import score_split
    from pipeline.evaluate.translate import read_split

    model_config = json.loads((Path(folder) / "meta.json").read_text())["model_config"]
    df = read_split(dev_dir, ["idx", "src_ids", "tgt"])
    if settings.sentences:
        df = df.iloc[:settings.sentences]
    with tempfile.TemporaryDirectory(prefix="dev-bleu-") as tmp:
        engine, ct2_model = _engine(folder, model_config, spm, settings, Path(tmp))
        hyps = decode(str(Path(folder) / "model.pt"), model_config, spm, settings, df["src_ids"], engine,
                      ct2_model, device, threads, batch_tokens)
    s = score_split(hyps, [str(t) for t in df["tgt"]], tgt_lang, preprocess)
    key = paper_metric(tgt_lang, preprocess)
    return {"bleu_sacre": s["bleu_sacre"], "chrf": s["chrf"], key: s[key], "tok_metric": key,
            "sacrebleu_signature": s["sacrebleu_signature"], "num_sentences": len(hyps), "engine": engine,
            "threads": threads, "device": device}


def _engine(folder: str, model_config: dict[str, Any], spm: str, settings: DevBleuSettings,
            tmp: Path) -> tuple[str, str]:
    """("ctranslate2-int8", its folder) converted here with the export code, or ("torch", "") when
    asked for or when Marian cannot hold the model (logged)."""
    if settings.engine == "torch":
        return "torch", ""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bars per checkpoint

    from model import ModelConfig
    from pipeline.serve.export import export_ct2, export_hf, unexportable

    mc = ModelConfig.from_dict(model_config)
    why = unexportable(mc)
    if why:
        log.warning("dev BLEU: CTranslate2 cannot hold this model (%s): decoding with our beam search", why)
        return "torch", ""
    state = torch.load(Path(folder) / "model.pt", weights_only=True, map_location="cpu")
    export_hf(state, mc, spm, tmp / "hf")
    export_ct2(tmp / "hf", tmp / "ct2", settings.quantization)
    return f"ctranslate2-{settings.quantization}", str(tmp / "ct2")


def decode(model_path: str, model_config: dict[str, Any], spm: str, settings: DevBleuSettings, src_ids: Any,
           engine: str, ct2_model: str, device: str, threads: int, batch_tokens: int) -> list[str]:
    """Hypotheses for ``src_ids`` in order, with translate's batching and bad-input handling."""
    import pandas as pd

    from pipeline.evaluate.translate import DecodeSettings, Translator, max_source_len, plan_split

    dec = DecodeSettings(settings.beam_size, settings.alpha, settings.max_len_a, settings.max_len_b)
    tr = Translator(model_path, model_config, spm, asdict(dec), device, threads,
                    backend="torch" if engine == "torch" else "ctranslate2", ct2_model=ct2_model)
    frame = pd.DataFrame({"idx": range(len(src_ids)), "src_ids": list(src_ids)})
    max_len = max_source_len(tr.cfg.max_positions, dec.max_len_a, dec.max_len_b)
    rows, _ = plan_split("dev", frame, max_len, tr.cfg.eos_id, batch_tokens)
    hyps = [""] * len(frame)
    for _, group in rows.groupby("batch_id", sort=False):
        out, failed = tr.translate_safely([list(s) for s in group["src_ids"]])
        if any(failed):
            raise RuntimeError(f"dev BLEU: {sum(failed)} sentence(s) failed to decode")
        for i, h in zip(group["idx"], out):
            hyps[int(i)] = h
    return hyps


# ----------------------------------------------------------------------------- records


def step_of(checkpoint_name: str) -> int:
    """``checkpoint_0000100`` -> 100 (pipeline.train.checkpoint.checkpoint_dir_name)."""
    return int(checkpoint_name.rsplit("_", 1)[-1])


def newest_registered_step(run_dir: str) -> int:
    """The step of the latest checkpoint Ray Train registered (its snapshot); -1 if unreadable."""
    try:
        snap = json.loads(storage.read_text(storage.join(run_dir, SNAPSHOT)))
        return step_of((snap.get("latest_checkpoint_result") or {})["checkpoint_dir_name"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def write_record(run_dir: str, record: dict[str, Any]) -> None:
    record = {**record, "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
    storage.write_json(storage.join(run_dir, RECORDS, f"{record['checkpoint']}.json"), record)


def record_names(run_dir: str) -> list[str]:
    """The names of the run's record files (none: [])."""
    try:
        return sorted(rel for rel, _ in storage.list_files(storage.join(run_dir, RECORDS)) if rel.endswith(".json"))
    except (FileNotFoundError, OSError):
        return []


def read_record(run_dir: str, name: str) -> dict[str, Any]:
    """One record (OSError / ValueError while it is being written)."""
    return storage.read_json(storage.join(run_dir, RECORDS, name))


def read_records(run_dir: str) -> list[dict[str, Any]]:
    """Every record of the run, by step (none: [])."""
    records = []
    for name in record_names(run_dir):
        try:
            records.append(read_record(run_dir, name))
        except (OSError, ValueError):
            log.warning("dev BLEU: unreadable record %s", storage.join(run_dir, RECORDS, name))
    return sorted(records, key=lambda r: r.get("step", 0))


def summarize(run_dir: str, cfg: Config, dev_dir: str, vocab: dict[str, Any]
              ) -> tuple[dict[str, Any], dict[str, float]]:
    """The train stage's ``dev_bleu`` output (what `average` needs to score a checkpoint the same
    way: the dev split and the SentencePiece model) and its count metrics."""
    why_not = unavailable(cfg, dev_dir, vocab)
    records = read_records(run_dir)
    counts = {s: sum(r.get("status") == s for r in records) for s in ("validated", "skipped", "failed")}
    out = {"enabled": why_not is None, "why_not": why_not, "run_dir": run_dir,
           "dev_dir": storage.absolute(dev_dir) if dev_dir else "",
           "spm": storage.absolute(vocab["model"]) if vocab.get("model") else "",
           "settings": DevBleuSettings.from_config(cfg).to_dict(), "records": records,
           **{f"num_{s}": n for s, n in counts.items()}}
    if records:
        log.info("train: dev BLEU on %d checkpoint(s), %d skipped (backlog), %d failed", counts["validated"],
                 counts["skipped"], counts["failed"])
    return out, {f"dev/bleu_num_{s}": float(n) for s, n in counts.items()} if records else {}


def scores_for(records: list[dict[str, Any]], settings: DevBleuSettings) -> dict[str, dict[str, Any]]:
    """checkpoint name -> its validated record made with ``settings``."""
    return {r["checkpoint"]: r for r in records
            if r.get("status") == "validated" and r.get("settings") == settings.to_dict()}


def _log_to_run(uri: str | None, run_id: str | None, metrics: dict[str, float], step: int) -> None:
    """Into the train stage's run at `step`; tracking trouble never fails a validation."""
    if not run_id:
        return
    from pipeline.tracking import RunLogger

    for attempt in range(3):
        try:
            RunLogger(uri, run_id, timeout_s=30.0).log_metrics(metrics, step=step)
            return
        except Exception as e:  # noqa: BLE001 - any store error (SQLite busy, a server away)
            if attempt == 2:
                log.warning("dev BLEU: could not log step %d to MLflow (%s)", step, e)
            time.sleep(1.0)


def report_lines(averaged: list[str]) -> list[str]:
    """Markdown for score's report: every checkpoint's dev BLEU during training (from the records
    beside the averaged checkpoints) and which were averaged; [] when there are none."""
    if not averaged:
        return []
    run_dir = averaged[0].rstrip("/").rsplit("/", 1)[0]
    records = read_records(run_dir)
    if not records:
        return []
    picked = {u.rstrip("/").rsplit("/", 1)[-1] for u in averaged}
    out = ["", "## Dev BLEU per checkpoint (during training)", "",
           "| step | dev sacreBLEU | dev chrF | status | engine | averaged |", "|---|---|---|---|---|---|"]
    for r in records:
        ok = r.get("status") == "validated"
        out.append(f"| {r.get('step')} | {r['bleu_sacre']:.2f} | {r['chrf']:.2f} |" if ok
                   else f"| {r.get('step')} | - | - |")
        out[-1] += f" {r.get('status')} | {r.get('engine', '-')} | {'yes' if r.get('checkpoint') in picked else ''} |"
    s = next((r["settings"] for r in reversed(records) if r.get("settings")), {})
    sentences = s.get("sentences") or "all"
    out += ["", f"Dev BLEU settings: {sentences} dev sentences, beam {s.get('beam_size')}, alpha {s.get('alpha')}, "
            f"max length {s.get('max_len_a')} * source + {s.get('max_len_b')}, engine {s.get('engine')} "
            f"({s.get('quantization')} for CTranslate2); `skipped` = a newer checkpoint was already "
            "registered when its turn came (Ray runs one validation at a time)."]
    return out


def table3_dev_bleu(train: dict[str, Any], metric: str) -> dict[str, Any]:
    """For the Table 3 runner: the dev BLEU of the row's final checkpoint (§6.2: no averaging) as
    validated during training, with its decoding settings; {} when training made none."""
    final = train.get("final_step")
    dev = train.get("dev_bleu") or {}
    rec = next((r for r in read_records(dev["run_dir"]) if r.get("step") == final
                and r.get("status") == "validated"), None) if dev.get("run_dir") else None
    if rec is None or metric not in rec:
        return {}
    s = rec["settings"]
    how = (f"dev BLEU of the step-{final} checkpoint during training: {rec['num_sentences']} sentences, "
           f"{rec['engine']}, beam {s['beam_size']}, alpha {s['alpha']}, max length {s['max_len_a']} * source + "
           f"{s['max_len_b']}")
    return {"bleu_dev_training": rec[metric], "bleu_sacre_dev_training": rec["bleu_sacre"],
            "bleu_dev_training_source": how}
