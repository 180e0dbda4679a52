"""``score``: BLEU and chrF of the detokenized hypotheses against the raw references.

Per split (``score.splits``): sacreBLEU (``bleu_sacre``, with its signature: the comparable
number), the paper's tokenized BLEU (German: with compound splitting, ``bleu_tok_cs``, the number
to set beside 27.3, t2t's get_ende_bleu.sh; other targets: ``bleu_tok``, Moses + multi-bleu, the
EN-FR number beside 38.1; see ``pipeline.decoding.bleu``) and chrF (``pipeline.decoding.scoring.score_split``).
References are the ``tgt`` column of the encoded split (the raw text, never filtered for the
test set), in ``idx`` order, the order ``translate`` wrote its lines in.

Writes ``scores.json`` and ``report.md`` (ours beside the paper's row) and logs both. The report
names the language pair and test set from the config; only WMT14 EN-DE and EN-FR runs get the
paper's Table 2 rows, and a run whose model is base or big is marked against its own row.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pipeline import storage
from pipeline.decoding.batching import read_split
from pipeline.decoding.dev_bleu_records import read_records
from pipeline.decoding.scoring import score_split, setup_of
from pipeline.stage import StageContext, StageResult

log = logging.getLogger(__name__)


# The paper's training compute for Table 2's rows (the sizes: pipeline.decoding.scoring).
_PAPER_COMPUTE = {"base": "12 h on 8 P100 = 96 GPU-hours", "big": "3.5 days on 8 P100 = 672 GPU-hours"}  # §5.2


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


def render_report(scores: dict[str, dict[str, Any]], facts: dict[str, dict[str, Any]], setup: dict[str, Any]) -> str:
    """A short Markdown page: the paper's rows for this pair (if any), ours, and how ours was made.

    `facts` holds the upstream stages' outputs by name (train, average, translate), each read
    from the stage that made it."""
    train, avg, tr = facts["train"], facts["average"], facts["translate"]
    mc, dec = train.get("model_config") or {}, tr.get("decode") or {}
    key, cs = setup["metric"], setup["metric"] == "bleu_tok_cs"
    column = {"bleu_tok_cs": "BLEU (tokenized, compound split)", "bleu_tok": "BLEU (tokenized)",
              "bleu_tok_lc": "BLEU4 (benchmark's lowercased tokenized text)"}[key]
    out = [f"# Transformer {setup['pair']}: results", "",
           f"| system | set | {column} | sacreBLEU | chrF |", "|---|---|---|---|---|"]
    for label, size, test_set, value in setup["paper"]:
        mark = " **(this run's row)**" if size == setup["size"] else ""
        out.append(f"| {label}{mark} | {test_set} | {value} | - | - |")
    for split, s in scores.items():
        out.append(f"| this run ({split}) | {setup['sets'].get(split, split)} | {_fmt(s[key])} "
                   f"| {_fmt(s['bleu_sacre'])} | {_fmt(s['chrf'])} |")
    averaged = avg.get("averaged") or []
    if setup["paper"]:
        out += ["", f"Only the {column} column is comparable with the published numbers; "
                "sacreBLEU is the number to compare with other work."]
    else:
        out += ["", f"The paper (Table 2) has no row for {setup['pair']} on this data: nothing here is "
                "set beside its numbers."]
    out += ["", "## How", "",
            f"- model: d_model {mc.get('d_model')}, d_ff {mc.get('d_ff')}, heads {mc.get('n_heads')}, "
            f"layers {mc.get('n_encoder_layers')}+{mc.get('n_decoder_layers')}, vocab {mc.get('vocab_size')}, "
            f"dropout {mc.get('dropout')}",
            f"- training: {train.get('final_step')} steps; averaged the "
            f"{'last' if avg.get('average_select', 'last') == 'last' else 'best-dev-BLEU'} {len(averaged)} checkpoint(s) "
            f"(steps {avg.get('steps')}); the paper averages 5 (base) / 20 (big), §6.1",
            _compute_line(train, setup["size"]),
            *_early_stop_lines(train),
            f"- decoding: beam {dec.get('beam_size')}, alpha {dec.get('alpha')}, max length "
            f"{dec.get('max_len_a')} * source + {dec.get('max_len_b')} (§6.1: 4, 0.6, source + 50); "
            f"engine: {dec.get('backend', 'torch')} (decode.backend)"]
    for split, s in scores.items():
        counts = (tr.get("splits") or {}).get(split, {})
        out += [f"- {split}: {s['num_sentences']} sentences, {counts.get('num_empty', '?')} empty sources, "
                f"{counts.get('num_truncated', '?')} truncated sources",
                f"  - sacreBLEU `{s['sacrebleu_signature']}`: {s['bleu_sacre_detail']}",
                f"  - chrF `{s['chrf_signature']}`",
                f"  - tokenized BLEU: {s[key + '_detail']}"]
    out += dev_bleu_lines(averaged)
    out += ["", _tokenized_note(setup["tgt_lang"], cs, setup.get("preprocess", "none")), ""]
    return "\n".join(out)


def _tokenized_note(lang: str, cs: bool, preprocess: str = "none") -> str:
    if preprocess == "lowercase_moses":
        return (f"Preprocessing (`data.preprocess = \"lowercase_moses\"`): every split, the references included, "
                "was lowercased, punctuation-normalized and Moses-tokenized as the benchmark's own "
                "scripts/task1-tokenize.sh does (sacremoses ports of lowercase.perl, normalize-punctuation.perl, "
                f"tokenizer.perl -l {lang}); the model trained and translates on that text. BLEU4 = corpus BLEU "
                "of the hypotheses against that reference, whitespace tokens, no smoothing (fairseq generate.py's "
                "and multi-bleu.perl's number). sacreBLEU and chrF: the hypotheses Moses-detokenized, against the "
                "raw reference (test; dev: its detokenized preprocessed text), case-insensitively (sacreBLEU's "
                "`-lc`, `case:lc` in the signature), since the model never saw a capital; comparable with "
                "other work's lowercased sacreBLEU only.")
    if cs:
        return ("Tokenized BLEU = tensor2tensor's `get_ende_bleu.sh` as of the paper's time (e1bde977, "
                "2017-11-08, before fc9335c0 added replace-unicode-punctuation.perl, which lowers scores by "
                "~0.5-0.8 BLEU): Moses `tokenizer.perl -l de` (sacremoses, escaping on as in the script) on "
                "hypothesis and reference, the ATAT split `s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g` on both "
                "(on UTF-8 bytes, as `perl -ple` runs it), then multi-bleu.perl's corpus BLEU.")
    return (f"Tokenized BLEU = Moses `tokenizer.perl -l {lang}` (sacremoses, escaping on) on hypothesis and "
            "reference, then multi-bleu.perl's corpus BLEU; no compound splitting (tensor2tensor published "
            "no EN-FR scoring script: its get_ende_bleu.sh is for German only).")


def _early_stop_lines(train: dict[str, Any]) -> list[str]:
    """The report's line when early stopping ended training (train's ``early_stop`` output)."""
    e = train.get("early_stop")
    if not e:
        return []
    best = f"{e['best']:.4f}" if isinstance(e.get("best"), (int, float)) else "?"
    return [f"- **stopped early** at step {e['step']} of train.max_steps = {e['max_steps']}: {e['metric']} did not "
            f"improve for {e['num_bad']} validation(s) (train.early_stop_patience = {e['patience']}; best {best} at "
            f"step {e['best_step']})"]


def _compute_line(c: dict[str, Any], size: str | None) -> str:
    if not c.get("wall_s"):
        return "- training compute: not recorded"
    paper = f" (paper, {size}: {_PAPER_COMPUTE[size]}, §5.2)" if size in _PAPER_COMPUTE else ""
    return (f"- training compute: {c['wall_s'] / 3600:.2f} h of training loop on {c.get('num_workers')} "
            f"{c.get('device')} worker(s), {c.get('gpu_hours', 0.0):.1f} GPU-hours{paper}")


def dev_bleu_lines(averaged: list[str]) -> list[str]:
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


def raw_references(ctx: StageContext, split: str, num_refs: int) -> list[str] | None:
    """The test split's raw reference lines (as downloaded, before ``data.preprocess``), for the cased
    sacreBLEU beside a benchmark's BLEU on its preprocessed text; None without preprocessing, and for
    the dev split (cleaning may drop dev pairs, so its lines need not align: its sacreBLEU is against
    the detokenized preprocessed reference). The test split is never filtered, so line i is idx i."""
    if ctx.cfg.data.preprocess == "none" or split != "test":
        return None
    from pipeline.data.clean import file_lines

    lines = []
    for line in file_lines(ctx.inputs["download"].outputs["test"]["tgt"]):
        if len(lines) == num_refs:
            break
        lines.append(line.decode("utf-8"))
    if len(lines) != num_refs:
        raise ValueError(f"score: the raw test reference has {len(lines)} lines for {num_refs} references")
    return lines


def _attention(ctx: StageContext) -> list[dict[str, Any]]:
    """Attention heatmaps of the first ``score.attention_sentences`` short test sentences, from the
    averaged model and its own translations (``pipeline.evaluate.attention_plots``), beside the report."""
    count = ctx.cfg.score.attention_sentences
    if not count:
        return []
    import tempfile
    from pathlib import Path

    from pipeline.evaluate.attention_plots import attention_figures

    enc, avg = ctx.inputs["encode"].outputs, ctx.inputs["average"].outputs
    df = read_split(enc["splits"]["test"]["dir"], ["idx", "src_ids"])
    if ctx.cfg.score.max_sentences:
        df = df.iloc[:ctx.cfg.score.max_sentences]
    hyps = read_hyps(ctx.inputs["translate"].outputs["splits"]["test"]["hyps"], len(df))
    with tempfile.TemporaryDirectory(prefix="attention-") as tmp:
        figures = attention_figures(avg["model"], avg["model_config"], ctx.inputs["vocab"].outputs["model"],
                                    [list(map(int, ids)) for ids in df["src_ids"]], hyps, count, Path(tmp))
        for fig in figures:
            for name in fig["files"].values():
                storage.upload(Path(tmp) / name, storage.absolute(storage.join(ctx.out_dir, "attention", name)))
    return figures


def attention_lines(figures: list[dict[str, Any]]) -> str:
    if not figures:
        return ""
    out = ["## What the model attends to", "",
           "Attention weights of the averaged model for a few test sentences and its own translations "
           "(every layer and head; `score.attention_sentences`), drawn by pipeline/evaluate/attention_plots.py "
           "into `attention/` beside this report (and the score run's MLflow artifacts):", ""]
    for n, fig in enumerate(figures, 1):
        out += [f"{n}. {fig['source']} -> {fig['translation']}",
                f"   [decoder cross-attention](attention/{fig['files']['cross']}), "
                f"[encoder self-attention](attention/{fig['files']['encoder_self']}); its cross-attention "
                "heads, as measured on this sentence (pipeline/decoding/attention_heads.py):"]
        out += [f"   - layer {layer}: " + "; ".join(f"head {head}: {label}" for head, label in enumerate(labels, 1))
                for layer, labels in enumerate(fig["heads"]["cross"], 1)]
    return "\n".join(out) + "\n"


def run(ctx: StageContext) -> StageResult:
    tr, enc = ctx.inputs["translate"].outputs, ctx.inputs["encode"].outputs
    setup = setup_of(ctx.cfg)
    key = setup["metric"]
    scores: dict[str, dict[str, Any]] = {}
    metrics: dict[str, float] = {}
    for split in ctx.cfg.score.splits:
        refs = [str(t) for t in read_split(enc["splits"][split]["dir"], ["idx", "tgt"])["tgt"]]
        if ctx.cfg.score.max_sentences:
            refs = refs[:ctx.cfg.score.max_sentences]
            log.warning("%s: scoring only the first %d sentences (score.max_sentences): not comparable "
                        "with the paper's full-test-set BLEU", split, len(refs))
        hyps = read_hyps(tr["splits"][split]["hyps"], len(refs))
        raw = raw_references(ctx, split, len(refs))
        s = scores[split] = score_split(hyps, refs, setup["tgt_lang"], setup["preprocess"], raw)
        log.info("%s %s: sacreBLEU %.2f (%s; reference: %s)", setup["pair"], split, s["bleu_sacre"],
                 s["sacrebleu_signature"], s["bleu_sacre_reference"])
        published = ", ".join(f"{label}: {value}" for label, _, _, value in setup["paper"]) or "no row"
        log.info("%s %s: %s %.2f (published: %s)", setup["pair"], split, key, s[key], published)
        log.info("%s %s: chrF %.2f (%s)", setup["pair"], split, s["chrf"], s["chrf_signature"])
        metrics.update({f"{split}/bleu_sacre": s["bleu_sacre"], f"{split}/{key}": s[key],
                        f"{split}/chrf": s["chrf"]})

    report = render_report(scores, {name: ctx.inputs[name].outputs for name in ("train", "average", "translate")},
                           setup)
    figures = _attention(ctx) if "test" in scores else []
    report += attention_lines(figures)
    if ctx.cfg.score.max_sentences:
        report = (f"> **Partial test set**: only the first {ctx.cfg.score.max_sentences} sentences of each split "
                  "were decoded and scored (`score.max_sentences`); these numbers are NOT comparable with "
                  "the paper's.\n\n" + report)
    scores_uri = storage.absolute(storage.join(ctx.out_dir, "scores.json"))
    report_uri = storage.absolute(storage.join(ctx.out_dir, "report.md"))
    storage.write_json(scores_uri, scores)
    storage.write_text(report_uri, report)
    ctx.tracker.log_text(json.dumps(scores, indent=2, sort_keys=True), "scores.json")
    ctx.tracker.log_text(report, "report.md")
    ctx.tracker.set_tags({f"{split}/sacrebleu_signature": s["sacrebleu_signature"] for split, s in scores.items()})
    for fig in figures:
        for name in fig["files"].values():
            uri = storage.absolute(storage.join(ctx.out_dir, "attention", name))
            ctx.tracker.log_artifact(str(storage.local_copy(uri)), "attention")
    keep = ("bleu_sacre", "sacrebleu_signature", "bleu_sacre_reference", key, f"{key}_signature", "chrf",
            "chrf_signature")
    return StageResult(outputs={"scores": {sp: {k: s[k] for k in keep} for sp, s in scores.items()},
                                "report": report_uri, "scores_file": scores_uri, "attention": figures},
                       metrics=metrics)
