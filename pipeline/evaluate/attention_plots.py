"""Heatmaps of what the averaged model attends to, for a few test sentences (``score``).

For each chosen sentence, its source pieces and the model's own translation (the hypothesis
``translate`` wrote, re-encoded) go through ``pipeline.decoding.attention_maps.translation_attention``
once (the Serve app's ``"attention": true`` calls it too), and two
figures are drawn with the pieces as axis labels, one panel per layer (rows) and head (columns):
- ``attention-<i>-cross.png``: decoder cross-attention (rows: target pieces, columns: source
  pieces): which source words each generated word looks at;
- ``attention-<i>-encoder.png``: encoder self-attention (source x source).
Each panel is titled with its head's measured character (``pipeline.decoding.attention_heads``:
"mostly attends to the previous piece: 71%", "follows the source in order", ...), which the
report lists too.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger(__name__)

MIN_PIECES, MAX_PIECES = 5, 16  # readable axis labels: sentences of this many source pieces


def pick_sentences(src_ids: Sequence[Sequence[int]], hyps: Sequence[str], count: int) -> list[int]:
    """``count`` test positions, in order: first those whose source has MIN..MAX pieces and whose
    hypothesis is not empty (readable axis labels), then, if too few, the shortest other sources."""
    fits = [i for i, (ids, hyp) in enumerate(zip(src_ids, hyps)) if MIN_PIECES <= len(ids) <= MAX_PIECES
            and hyp.strip()][:count]
    rest = sorted((i for i, ids in enumerate(src_ids) if ids and i not in set(fits)), key=lambda i: len(src_ids[i]))
    return sorted(fits + rest[:count - len(fits)])


def draw(maps: Any, src_pieces: list[str], tgt_pieces: list[str], kind: str, path: Path, title: str,
         labels: Sequence[Sequence[str]] = ()) -> Path:
    """One grid of heatmaps (layers x heads) of ``maps`` (L, h, Tq, Tk) to ``path`` (PNG); ``labels``
    [layer][head], each head's measured character (``attention_heads``), under its panel's title."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L, H, tq, tk = maps.shape
    rows, cols = (tgt_pieces, src_pieces) if kind == "cross" else (src_pieces, src_pieces)
    assert (len(rows), len(cols)) == (tq, tk), (kind, len(rows), len(cols), tq, tk)
    # A panel's sides follow its own axes (0.22 in per piece), and the pieces label the outer panels
    # only (the grid shares its axes): drawing the labels and the pixels is most of the time, 1.5-2x
    # less this way (docs/benchmarks.md, "Local mode in 300 steps").
    width, height = 0.22 * tk + 1.2, 0.22 * tq + 1.2
    fig, axes = plt.subplots(L, H, figsize=(H * width, L * height), squeeze=False, sharex=True, sharey=True,
                             layout="constrained")
    for layer in range(L):
        for head in range(H):
            ax = axes[layer][head]
            ax.imshow(maps[layer, head].numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
            if layer == L - 1:
                ax.set_xticks(range(tk), cols, rotation=90, fontsize=6)
            if head == 0:
                ax.set_yticks(range(tq), rows, fontsize=6)
            label = "\n" + textwrap.fill(labels[layer][head], width=max(24, int(width * 9))) if labels else ""
            ax.set_title(f"layer {layer + 1}, head {head + 1}{label}", fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def attention_figures(model_path: str, model_config: dict[str, Any], spm_path: str, src_ids: list[list[int]],
                      hyps: list[str], count: int, out_dir: Path) -> list[dict[str, Any]]:
    """Draw the maps of up to ``count`` test sentences into ``out_dir``; what was drawn (file
    names, the sentence, its translation)."""
    import sentencepiece as spm

    from pipeline import storage
    from pipeline.decoding.attention_maps import translation_attention
    from pipeline.decoding.translator import load_model

    sp = spm.SentencePieceProcessor(model_file=str(storage.local_copy(spm_path)))
    model = load_model(model_path, model_config)
    out = []
    for n, i in enumerate(pick_sentences(src_ids, hyps, count)):
        att = translation_attention(model, sp, src_ids[i], hyps[i])  # the Serve app's numbers too
        maps, src_pieces, tgt_pieces = att.maps, att.src_pieces, att.tgt_pieces
        source = sp.decode(list(src_ids[i]))
        files, heads = {}, {}
        for kind, name in (("cross", "cross"), ("encoder_self", "encoder")):
            heads[kind] = [[h["label"] for h in layer] for layer in att.heads[kind]]
            path = out_dir / f"attention-{n + 1}-{name}.png"
            what = "decoder cross-attention (rows: translation, columns: source)" if kind == "cross" else \
                "encoder self-attention"
            draw(maps[kind], src_pieces, tgt_pieces, kind, path, f"{what}\n{source}  ->  {hyps[i]}", heads[kind])
            files[kind] = path.name
        out.append({"index": i, "source": source, "translation": hyps[i], "files": files, "heads": heads})
    log.info("score: attention maps of %d test sentence(s) drawn", len(out))
    return out
