"""Scores and the report: sacreBLEU against the raw reference, the side-by-side table and its notes."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peer import log


@dataclass(kw_only=True)
class Sides:
    """Both sides' results, as the report reads them."""

    args: argparse.Namespace
    ours: dict[str, Any]  # run_ours: our resolved config ("cfg") and stage manifests ("manifests")
    our: dict[str, Any]  # score_ours: our train loop's seconds and target tokens, our test sacreBLEU
    eole: dict[str, Any]  # run_eole: eole's data, batch_size, config, training and decodes
    steps: int  # our train.max_steps
    ckpt: int  # the checkpoint interval of both sides, steps


def sacre(hyps: list[str], refs: list[str]) -> dict[str, Any]:
    """sacreBLEU with its default settings: the score, its signature and its detail line."""
    import sacrebleu

    bleu = sacrebleu.metrics.BLEU()
    s = bleu.corpus_score(hyps, [refs])
    return {"bleu": s.score, "signature": str(bleu.get_signature()), "detail": str(s)}


def raw_refs(ours: dict[str, Any], n: int) -> list[str]:
    """The first ``n`` lines of the raw German test reference our download stage fetched."""
    from pipeline.data.clean import file_lines

    lines = []
    for line in file_lines(ours["manifests"]["download"].outputs["test"]["tgt"]):
        if len(lines) == n:
            break
        lines.append(line.decode("utf-8").rstrip("\n"))
    if len(lines) != n:
        raise SystemExit(f"the raw test reference has {len(lines)} lines, expected {n}")
    return lines


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def table(rows: list[tuple[str, Any, Any, Any]]) -> str:
    """The rows (name, ours, eole, ours / eole) as a Markdown table."""
    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    out = ["| | ours | eole 0.6.4 | ours / eole |", "|---|---:|---:|---:|"]
    out += [f"| {name} | {fmt(a)} | {fmt(b)} | {fmt(r)} |" for name, a, b, r in rows]
    return "\n".join(out)


def rows(s: Sides) -> list[tuple[str, Any, Any, Any]]:
    """The table's rows: (metric, ours, eole, ours / eole)."""
    man, et, e_avg = s.ours["manifests"], s.eole["train"], s.eole["decodes"]["averaged"]
    tr, tx = man["train"].outputs, man["translate"].outputs
    our_train_s, our_tokens, our_score = s.our["train_s"], s.our["tokens"], s.our["score"]
    our_tok_s = our_tokens / our_train_s
    return [
        ("training wall time, s (train loop)", our_train_s, et["loop_s"], ratio(our_train_s, et["loop_s"])),
        ("steps trained", int(tr["final_step"]), int(et["steps_logged"]), ratio(tr["final_step"], et["steps_logged"])),
        ("target tokens per step", our_tokens / tr["final_step"], et["tgt_tokens_per_step"],
         ratio(our_tokens / tr["final_step"], et["tgt_tokens_per_step"])),
        ("target tokens/s", our_tok_s, et["tgt_tokens_per_s"], ratio(our_tok_s, et["tgt_tokens_per_s"])),
        ("sacreBLEU, last-5 average (equal wall time)", our_score["bleu"], e_avg["score"]["bleu"],
         ratio(our_score["bleu"], e_avg["score"]["bleu"])),
        ("decode s, test_2016_flickr (beam 4, alpha 0.6)", tx["wall_s"], e_avg["process_wall_s"],
         ratio(tx["wall_s"], e_avg["process_wall_s"])),
    ]


def notes(s: Sides) -> list[str]:
    """What the table compares and how: data, model, precision, the differences that remain."""
    args, cfg, man, et = s.args, s.ours["cfg"], s.ours["manifests"], s.eole["train"]
    st, tx = s.eole["data"]["stats"]["train"], man["translate"].outputs
    n_test = tx["splits"]["test"]["num_sentences"]
    e_avg, batch_size = s.eole["decodes"]["averaged"], s.eole["batch_size"]
    out = [
        f"Multi30k task 1 EN->DE (raw, cased), {st['pairs']} training pairs, test_2016_flickr {n_test} sentences; "
        f"sacreBLEU `{s.our['score']['signature']}` against the raw German reference.",
        f"Model: d_model {cfg.model.d_model}, d_ff {cfg.model.d_ff}, {cfg.model.n_heads} heads, "
        f"{cfg.model.n_encoder_layers}+{cfg.model.n_decoder_layers} layers, shared "
        f"{s.eole['data']['vocab_pieces'] + 4}-piece "
        f"vocabulary (our spm.model), dropout {cfg.model.dropout}, label smoothing {cfg.train.label_smoothing}, "
        f"Noam lr factor {cfg.train.lr_scale} / {cfg.train.warmup_steps} warmup, ~{cfg.train.tokens_per_step} target "
        f"tokens per step, last {cfg.average.checkpoints} checkpoints (every {s.ckpt} steps) averaged.",
        f"Precision: ours speed.precision = {cfg.speed.precision!r} -> {man['train'].outputs.get('precision')}; "
        f"eole compute_dtype {args.eole_dtype}.",
        "Norm placement: ours post-norm (the paper's); eole PRE-norm (eole 0.6.4 has no post-norm decoder layer).",
        f"Training time: ours = the train stage's loop time (manifest wall_s), budget {args.budget_s:.0f} s as "
        f"max_steps {s.steps}; eole = stopped {et['loop_s']:.0f} s after its 'Start training loop' line (start-up "
        f"excluded on both sides). eole's steps and target tokens are from its last log line (step "
        f"{et['steps_logged']} at {et['seconds_at_last_log']:.0f} s; tokens = sum of its mean target tokens per batch "
        f"x steps of each report window, over those seconds); its last checkpoint is step "
        f"{et['checkpoint_steps'][-1] if et['checkpoint_steps'] else None}.",
        f"eole batching: batch_size {batch_size} in its padded max(src, tgt) tokens (set from the data for "
        f"~{cfg.train.tokens_per_step} target tokens); DataLoader workers {args.eole_num_workers}; "
        "attention_dropout 0 (ours has none); log_attention_entropy off.",
        "Decode seconds: ours = the translate stage's decode (Ray Data actor start, model load and beam search; "
        f"backend {tx['decode']['backend']}); eole = the whole `eole predict` process (imports, model load, "
        f"decoding; its own loop time {e_avg['loop_s']} s), default batch (30 sentences) and length caps "
        "(max_length 250, ratio 2; ours: source + 50).",
        f"eole unaveraged (last checkpoint): sacreBLEU {s.eole['decodes']['last']['score']['bleu']:.2f}.",
        f"Our score stage's own sacreBLEU: {man['score'].outputs['scores']['test'].get('bleu_sacre')}.",
    ]
    if args.smoke:
        out.insert(0, "SMOKE RUN: tiny model, sliced data: plumbing check only, the numbers mean nothing.")
    return out


def write_result(s: Sides, versions: dict[str, str], t_all: float) -> None:
    """Prints the table and its notes; writes them with both sides' figures to --out as JSON."""
    man, args = s.ours["manifests"], s.args
    tr, tx = man["train"].outputs, man["translate"].outputs
    table_rows, table_notes = rows(s), notes(s)
    md = table(table_rows) + "\n\n" + "\n".join(f"- {n}" for n in table_notes)
    print("\n" + md + "\n", flush=True)
    result = {
        "rows": [{"metric": n, "ours": a, "eole": b, "ours_over_eole": r} for n, a, b, r in table_rows],
        "markdown": md, "notes": table_notes, "smoke": args.smoke, "budget_s": args.budget_s,
        "ours": {"train": {k: tr.get(k) for k in ("final_step", "wall_s", "tokens_seen", "precision", "data")},
                 "train_key": man["train"].key, "translate_wall_s": tx["wall_s"],
                 "translate_stage_wall_s": man["translate"].extra.get("wall_s"), "score": s.our["score"],
                 "score_stage": man["score"].outputs["scores"].get("test"), "max_steps": s.steps,
                 "checkpoint_interval_steps": s.ckpt, "work_dir": args.work_dir},
        "eole": {"versions": versions, "train": s.eole["train"], "batch_size": s.eole["batch_size"],
                 "decode": s.eole["decodes"], "config": str(s.eole["yaml_path"]),
                 "data_stats": s.eole["data"]["stats"]},
        "wall_s_total": time.monotonic() - t_all,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    log(f"wrote {args.out}")
