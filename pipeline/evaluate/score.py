"""``score``: BLEU and chrF of the detokenized hypotheses against the raw references.

Per split (``eval.splits``): sacreBLEU (``bleu_sacre``, with its signature: the comparable
number), the paper's tokenized BLEU with compound splitting (``bleu_tok_cs``, the number to
set beside 27.3; see ``pipeline.evaluate.bleu`` for how it reproduces t2t's get_ende_bleu.sh) and chrF.
References are the ``tgt`` column of the encoded split (the raw text, never filtered for the
test set), in ``idx`` order, the order ``translate`` wrote its lines in.

Writes ``scores.json`` and ``report.md`` (ours beside the paper's row) and logs both.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pipeline import storage
from pipeline.evaluate import bleu
from pipeline.stage import StageContext, StageResult
from pipeline.evaluate.translate import read_split

log = logging.getLogger(__name__)


def score_split(hyps: list[str], refs: list[str]) -> dict[str, Any]:
    """All three metrics with their signatures and details (pure)."""
    sacre, tok, cf = bleu.sacre_bleu(hyps, refs), bleu.tokenized_bleu_cs(hyps, refs), bleu.chrf(hyps, refs)
    return {"bleu_sacre": sacre.score, "sacrebleu_signature": sacre.signature, "bleu_sacre_detail": sacre.detail,
            "bleu_tok_cs": tok.score, "bleu_tok_cs_signature": tok.signature, "bleu_tok_cs_detail": tok.detail,
            "chrf": cf.score, "chrf_signature": cf.signature, "num_sentences": len(hyps)}


def read_hyps(uri: str, num_refs: int) -> list[str]:
    lines = storage.read_text(uri).split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the file ends with a newline
    if len(lines) != num_refs:
        raise ValueError(f"{uri}: {len(lines)} hypotheses for {num_refs} references; "
                         "translate must write one line per source sentence")
    return lines


def _fmt(x: Any, digits: int = 2) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) else str(x)


def render_report(scores: dict[str, dict[str, Any]], tr: dict[str, Any]) -> str:
    """A short Markdown page: the paper's row, ours, and how ours was made."""
    mc, dec = tr.get("model_config") or {}, tr.get("decode") or {}
    out = ["# Transformer EN-DE: results", "",
           "| system | newstest | BLEU (tokenized, compound split) | sacreBLEU | chrF |",
           "|---|---|---|---|---|",
           f"| paper, Transformer base (Table 2) | 2014 | {bleu.PAPER_BLEU['base']} | - | - |",
           f"| paper, Transformer big (Table 2) | 2014 | {bleu.PAPER_BLEU['big']} | - | - |"]
    for split, s in scores.items():
        year = {"test": "2014", "dev": "2013"}.get(split, split)
        out.append(f"| this run ({split}) | {year} | {_fmt(s['bleu_tok_cs'])} | {_fmt(s['bleu_sacre'])} "
                   f"| {_fmt(s['chrf'])} |")
    averaged = tr.get("averaged") or []
    out += ["", "Only the tokenized, compound-split column is comparable with the paper's numbers; "
            "sacreBLEU is the number to compare with other work.", "",
            "## How", "",
            f"- model: d_model {mc.get('d_model')}, d_ff {mc.get('d_ff')}, heads {mc.get('n_heads')}, "
            f"layers {mc.get('n_encoder_layers')}+{mc.get('n_decoder_layers')}, vocab {mc.get('vocab_size')}, "
            f"dropout {mc.get('dropout')}",
            f"- training: {tr.get('train_final_step')} steps; averaged the last {len(averaged)} checkpoint(s) "
            f"(steps {tr.get('averaged_steps')}); the paper averages 5 (base) / 20 (big), §6.1",
            _compute_line(tr.get("train_compute") or {}),
            f"- decoding: beam {dec.get('beam_size')}, alpha {dec.get('alpha')}, max length "
            f"{dec.get('max_len_a')} * source + {dec.get('max_len_b')} (§6.1: 4, 0.6, source + 50); "
            f"engine: {dec.get('backend', 'torch')} (eval.backend)"]
    for split, s in scores.items():
        counts = (tr.get("splits") or {}).get(split, {})
        out += [f"- {split}: {s['num_sentences']} sentences, {counts.get('num_empty', '?')} empty sources, "
                f"{counts.get('num_truncated', '?')} truncated sources",
                f"  - sacreBLEU `{s['sacrebleu_signature']}`: {s['bleu_sacre_detail']}",
                f"  - chrF `{s['chrf_signature']}`",
                f"  - tokenized BLEU: {s['bleu_tok_cs_detail']}"]
    out += ["", "Tokenized BLEU = tensor2tensor's `get_ende_bleu.sh`: Moses `tokenizer.perl -l de` "
            "(sacremoses, escaping on as in the script) on hypothesis and reference, the ATAT split "
            "`s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g` on both, then multi-bleu.perl's corpus BLEU.", ""]
    return "\n".join(out)


def _compute_line(c: dict[str, Any]) -> str:
    if not c.get("wall_s"):
        return "- training compute: not recorded"
    return (f"- training compute: {c['wall_s'] / 3600:.2f} h of training loop on {c.get('num_workers')} "
            f"{c.get('device')} worker(s), {c.get('gpu_hours', 0.0):.1f} GPU-hours "
            "(paper, base: 12 h on 8 P100 = 96 GPU-hours, §5.2)")


def run(ctx: StageContext) -> StageResult:
    tr, enc = ctx.inputs["translate"].outputs, ctx.inputs["encode"].outputs
    scores: dict[str, dict[str, Any]] = {}
    metrics: dict[str, float] = {}
    for split in ctx.cfg.eval.splits:
        refs = [str(t) for t in read_split(enc["splits"][split]["dir"], ["idx", "tgt"])["tgt"]]
        if ctx.cfg.eval.max_sentences:
            refs = refs[:ctx.cfg.eval.max_sentences]
            log.warning("%s: scoring only the first %d sentences (eval.max_sentences): not comparable "
                        "with the paper's full-test-set BLEU", split, len(refs))
        hyps = read_hyps(tr["splits"][split]["hyps"], len(refs))
        s = scores[split] = score_split(hyps, refs)
        log.info("%s: sacreBLEU %.2f (%s)", split, s["bleu_sacre"], s["sacrebleu_signature"])
        log.info("%s: tokenized compound-split BLEU %.2f (paper, base: %.1f)", split, s["bleu_tok_cs"],
                 bleu.PAPER_BLEU["base"])
        log.info("%s: chrF %.2f (%s)", split, s["chrf"], s["chrf_signature"])
        metrics.update({f"{split}/bleu_sacre": s["bleu_sacre"], f"{split}/bleu_tok_cs": s["bleu_tok_cs"],
                        f"{split}/chrf": s["chrf"]})

    report = render_report(scores, tr)
    if ctx.cfg.eval.max_sentences:
        report = (f"> **Partial test set**: only the first {ctx.cfg.eval.max_sentences} sentences of each split "
                  "were decoded and scored (`eval.max_sentences`); these numbers are NOT comparable with "
                  "the paper's.\n\n" + report)
    scores_uri = storage.absolute(storage.join(ctx.out_dir, "scores.json"))
    report_uri = storage.absolute(storage.join(ctx.out_dir, "report.md"))
    storage.write_json(scores_uri, scores)
    storage.write_text(report_uri, report)
    ctx.tracker.log_text(json.dumps(scores, indent=2, sort_keys=True), "scores.json")
    ctx.tracker.log_text(report, "report.md")
    ctx.tracker.set_tags({f"{split}/sacrebleu_signature": s["sacrebleu_signature"] for split, s in scores.items()})
    keep = ("bleu_sacre", "sacrebleu_signature", "bleu_tok_cs", "chrf", "chrf_signature")
    return StageResult(outputs={"scores": {sp: {k: s[k] for k in keep} for sp, s in scores.items()},
                                "report": report_uri, "scores_file": scores_uri},
                       metrics=metrics)
