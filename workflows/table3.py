"""Table 3 of Vaswani et al. (2017): the paper's values, which rows exist, and how ours are shown.

Besides the paper's rows (base, A-E, big), the rows after 2017 (group ``later``: pre-norm, RMSNorm,
SwiGLU, rotary positions, and all four at once) vary the base model the same way, one
`[model]` option each; the paper has no numbers for them.

`render_table` writes the Markdown table (ours beside the paper's, failed rows marked with their
reason), `write_figure` the PNG: dev PPL and dev BLEU per row, ours beside the paper's, grouped
as the paper groups its rows (A-E, with base and big at the ends, the later rows after them).
"""

from __future__ import annotations

from typing import Any

from pipeline.config import Config, ConfigError

# Table 3 of the paper (EN-DE, newstest2013): row -> (what varies, PPL (dev), BLEU (dev), params x 10^6).
# PPL is per word-piece; the paper gives parameter counts for some rows only.
PAPER: dict[str, tuple[str, float, float, float | None]] = {
    "base": ("base", 4.92, 25.8, 65),
    "A1": ("h=1, d_k=d_v=512", 5.29, 24.9, None), "A2": ("h=4, d_k=d_v=128", 5.00, 25.5, None),
    "A3": ("h=16, d_k=d_v=32", 4.91, 25.8, None), "A4": ("h=32, d_k=d_v=16", 5.01, 25.4, None),
    "B1": ("d_k=16", 5.16, 25.1, 58), "B2": ("d_k=32", 5.01, 25.4, 60),
    "C1": ("N=2", 6.11, 23.7, 36), "C2": ("N=4", 5.19, 25.3, 50), "C3": ("N=8", 4.88, 25.5, 80),
    "C4": ("d_model=256, d_k=d_v=32", 5.75, 24.5, 28), "C5": ("d_model=1024, d_k=d_v=128", 4.66, 26.0, 168),
    "C6": ("d_ff=1024", 5.12, 25.4, 53), "C7": ("d_ff=4096", 4.75, 26.2, 90),
    "D1": ("P_drop=0.0", 5.77, 24.6, None), "D2": ("P_drop=0.2", 4.95, 25.5, None),
    "D3": ("eps_ls=0.0", 4.67, 25.3, None), "D4": ("eps_ls=0.2", 5.47, 25.7, None),
    "E": ("positional embedding instead of sinusoids", 4.92, 25.7, None),
    "big": ("big", 4.33, 26.4, 213),
}
# The rows after 2017: row -> (what varies, None, None, None); the paper has no values for them.
LATER: dict[str, tuple[str, None, None, None]] = {
    "prenorm": ("pre-norm (Xiong et al., 2020)", None, None, None),
    "rmsnorm": ("RMSNorm (Zhang & Sennrich, 2019)", None, None, None),
    "swiglu": ("SwiGLU FFN (Shazeer, 2020)", None, None, None),
    "rotary": ("rotary positions (Su et al., 2021)", None, None, None),
    "later": ("all four above", None, None, None),
}
ROWS: dict[str, tuple[str, float | None, float | None, float | None]] = {**PAPER, **LATER}
# The groups, in the paper's order (the figure's x axis), the later rows last.
GROUPS: dict[str, str] = {"base": "base", "A": "(A) heads", "B": "(B) d_k", "C": "(C) size",
                          "D": "(D) dropout, ls", "E": "(E) positions", "big": "big", "later": "after 2017"}


def group_of(row: str) -> str:
    if row in LATER:
        return "later"
    return row if row in ("base", "big") else row[0]


def expand_rows(spec: str) -> list[str]:
    """``"A,B,big"`` -> ``["A1", .., "A4", "B1", "B2", "big"]``: a letter is its whole group;
    ``"after2017"`` is the later rows (each option alone, then all four)."""
    rows: list[str] = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        group = [r for r in PAPER if r[0] == item and r[1:].isdigit()] if len(item) == 1 else []
        if item in ROWS:
            group = [item]
        elif item == "after2017":
            group = list(LATER)
        if not group:
            raise ConfigError(f"--rows: unknown row '{item}' (rows: {', '.join(ROWS)}; or a group A, B, C, D, "
                              "after2017)")
        rows += [r for r in group if r not in rows]
    return rows


def _num(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _status(r: dict[str, Any]) -> str:
    if r.get("status", "done") == "done":
        return "done"
    reason = " ".join(str(r.get("error", "")).split()).replace("|", "\\|")
    reason = reason if len(reason) <= 200 else reason[:197] + "..."
    return f"**failed** at {r.get('failed_stage') or '?'}: {reason}"


def papers_task(cfg: Config) -> bool:
    """Whether the recipe is the paper's Table 3 task (WMT14 EN-DE, scored on newstest2013): only
    then do the paper's values stand beside ours."""
    return cfg.data.source == "wmt14" and (cfg.data.src_lang, cfg.data.tgt_lang) == ("en", "de")


def render_table(results: list[dict[str, Any]], cfg: Config) -> str:
    """Markdown: each row's PPL / BLEU / params (ours) beside the paper's, its training time, and
    its status. A test BLEU column when the rows were scored on the test split too; the paper's
    columns only on the paper's task (another recipe's numbers do not compare with them)."""
    papers = papers_task(cfg)
    test = any(r.get("bleu_test") is not None for r in results)
    dev_set = "newstest2013" if cfg.data.source == "wmt14" else "the dev split"
    cols = ["row", "variation", "steps", "PPL dev (ours)", *(["PPL dev (paper)"] if papers else []),
            "BLEU dev (ours)", *(["BLEU dev (paper)"] if papers else []), *(["BLEU test (ours)"] if test else []),
            "params x10^6 (ours)", *(["params x10^6 (paper)"] if papers else []), "train wall", "status"]
    out = [f"# Table 3 (Vaswani et al., 2017): model variations, {dev_set}", "", "| " + " | ".join(cols) + " |",
           "|" + "---|" * len(cols)]
    for r in results:
        what, ppl, bleu, params = ROWS[r["row"]]
        cells = [r["row"], what, _num(r.get("train_steps"), "d"), _num(r.get("ppl_dev"), ".2f"),
                 *([_num(ppl, ".2f")] if papers else []), _num(r.get("bleu_dev"), ".1f"),
                 *([_num(bleu, ".1f")] if papers else []), *([_num(r.get("bleu_test"), ".2f")] if test else []),
                 f"{r['params'] / 1e6:.1f}", *([_num(params, ".0f")] if papers else []),
                 _minutes(r.get("train_wall_s")), _status(r)]
        out.append("| " + " | ".join(cells) + " |")
    metric = next((r["bleu_metric"] for r in results if r.get("bleu_metric")), "bleu_tok_cs")
    averaged = ("no checkpoint averaging (§6.2)" if cfg.average.checkpoints == 1 else
                f"the average of {cfg.average.checkpoints} checkpoints ({cfg.average.select})")
    out += ["", f"Ours: beam {cfg.decode.beam_size}, alpha {cfg.decode.alpha}, {averaged}; BLEU = `{metric}`"
            f"{' (the tokenized BLEU of Table 2)' if metric == 'bleu_tok_cs' else ''}; PPL = exp(NLL per target "
            "piece) of the last step's model on dev (train stage's `val/final_ppl`); train wall = the training "
            f"loop's time (summed over attempts when a run was resumed). Our pieces come from a SentencePiece "
            f"{cfg.vocab.model_type} model of {cfg.vocab.size} pieces, not the paper's word-pieces, so PPL values "
            "compare between rows"
            + (", not exactly with the paper's." if papers else "; the paper's values (WMT14 EN-DE newstest2013) "
               "are not shown for this recipe."), ""]
    failed = [r["row"] for r in results if r.get("status", "done") != "done"]
    if failed:
        out += [f"Failed rows: {', '.join(failed)}. Rerun the same command to continue them (finished rows "
                "and finished stages are cached).", ""]
    if cfg.score.max_sentences:
        out.insert(0, f"> **Partial dev set**: only the first {cfg.score.max_sentences} sentences were decoded "
                      "(`score.max_sentences`): not comparable with the paper.\n")
    return "\n".join(out)


def _minutes(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 60:.1f} min"


def _positions(rows: list[str]) -> tuple[list[float], list[tuple[str, float, float]]]:
    """x of each row (in ROWS order, a gap between groups) and each group's (label, x0, x1)."""
    xs, spans, x, last = [], [], 0.0, None
    for row in rows:
        g = group_of(row)
        if last is not None and g != last:
            x += 0.8
        if g != last:
            spans.append((GROUPS[g], x, x))
        spans[-1] = (spans[-1][0], spans[-1][1], x)
        xs.append(x)
        x, last = x + 1.0, g
    return xs, spans


def write_figure(results: list[dict[str, Any]], path: str, title: str = "", papers: bool = True) -> None:
    """Dev PPL (log scale) and dev BLEU per row, ours beside the paper's (where it has a value and
    ``papers``: the recipe is the paper's task), grouped A-E, then the later rows, as a PNG.

    Points, not bars: a tiny run's PPL sits orders of magnitude above the paper's ~5, which
    only a log axis shows, and bars on a log axis mislead. matplotlib's object API (`Figure`),
    not pyplot: pyplot keeps global state, and the driver runs rows in several threads."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    by_row = {r["row"]: r for r in results}
    rows = [r for r in ROWS if r in by_row]
    xs, spans = _positions(rows)
    fig = Figure(figsize=(max(6.0, 0.55 * len(rows) + 3.0), 6.2))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 1, sharex=True)
    for ax, key, paper_i, label, fmt in ((axes[0], "ppl_dev", 1, "dev PPL (per piece, log)", ".2f"),
                                         (axes[1], "bleu_dev", 2, "dev BLEU", ".1f")):
        _panel(ax, [by_row[r] for r in rows], xs, [ROWS[r][paper_i] if papers else None for r in rows], key, fmt)
        ax.set_ylabel(label)
        for _, x0, _ in spans[1:]:
            ax.axvline(x0 - 0.9, color="#dddddd", lw=0.8)
    axes[0].legend(fontsize=8, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=2, frameon=False)
    axes[1].set_xticks(xs, rows, fontsize=8)
    for name, x0, x1 in spans:
        if name not in rows:  # base and big are their own group: their tick says it
            axes[1].annotate(name, ((x0 + x1) / 2, 0), xytext=(0, -20), textcoords="offset points",
                             ha="center", va="top", fontsize=8, xycoords=("data", "axes fraction"))
    fig.suptitle(title or ("Table 3: model variations on newstest2013, ours beside the paper's" if papers else
                           "Table 3's variations on this recipe's dev split"), fontsize=10)
    fig.tight_layout()
    fig.subplots_adjust(bottom=0.13)
    fig.savefig(path, dpi=110)


def _panel(ax: Any, results: list[dict[str, Any]], xs: list[float], paper: list[float | None], key: str,
           fmt: str) -> None:
    """One metric (``key``: ppl_dev on a log axis, else bleu_dev from 0) of each row at ``xs``: the
    paper's value (an open diamond), ours (a point, labelled) and a line between; "failed" or "n/a"
    where a row has none."""
    shown = [(x, p) for x, p in zip(xs, paper) if p is not None]
    if shown:
        ax.plot(*zip(*shown), "D", color="#888888", mfc="none", ms=7, label="paper", zorder=3)
    for x, r, p in zip(xs, results, paper):
        v = r.get(key)
        if v is None:
            ax.annotate("failed" if r.get("status") == "failed" else "n/a", (x, 0),
                        xytext=(0, 9), textcoords="offset points", ha="center", color="#c0392b", fontsize=8,
                        xycoords=("data", "axes fraction"))
            continue
        if p is not None:
            ax.plot([x, x], [p, v], color="#c8d6e5", lw=2, zorder=1)
        ax.plot([x], [v], "o", color="#3b75af", ms=7, zorder=4, label="ours" if "ours" not in
                [t.get_label() for t in ax.lines] else "_")
        ax.annotate(format(v, fmt), (x, v), xytext=(7, 0), textcoords="offset points", va="center", fontsize=7)
    ax.margins(x=0.08, y=0.15)
    if key == "ppl_dev":
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.grid(axis="y", color="#eeeeee", which="both")
