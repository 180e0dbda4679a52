"""A tiny Transformer really trained here (seconds, CPU), for the export, backend, registry and serve tests.

SentencePiece BPE (our fixed ids: pad 0, unk 1, bos 2, eos 3) on a parallel text, then a 2+2-layer
model trained with our loss, Adam and Noam schedule (model/) for a few hundred steps: its greedy
outputs are real, input-dependent strings of every length, not one token repeated, which is what
the round trips (ours against transformers, CTranslate2, MLflow, Ray Serve) need to mean something.

The tests train it on the generated toy language (`toy_pairs`: tests/support/synthetic_mirror.py's
grammar; their point is the round trips, not the text), so they run on a clone without
``../shared``; the held-out sentences they translate come from `toy_pairs` with another seed. The
reference trace and the benchmarks train it on WMT news text (`news_pairs`): a barely trained
model's near-tied beams are what a change of the search shows in.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from model import ModelConfig, NonPad, Transformer, label_smoothed_nll, make_optimizer, make_scheduler

VOCAB_SIZE = 600
MAX_PIECES = 40  # training pairs longer than this (either side) are skipped
LR_SCALE = 0.5  # peak lr 0.5 * 64^-0.5 * 100^-0.5 = 0.006 (§5.3's formula; 2x collapses to one token)
MODEL = dict(d_model=64, d_ff=128, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, max_positions=256,
             dropout=0.0)
TOY_TRAIN_SEED, TOY_TEST_SEED = 0, 1  # the training text and the held-out sentences the tests translate

Pairs = tuple[list[str], list[str]]  # (English lines, German lines)


def news_pairs(wmt14_dir: Path) -> Pairs:
    """The news-commentary training sample of the offline WMT14 data (``../shared/data/wmt14``)."""
    base = wmt14_dir / "train-sample"
    en = (base / "news-commentary-v11.train.en").read_text(encoding="utf-8").splitlines()
    de = (base / "news-commentary-v11.train.de").read_text(encoding="utf-8").splitlines()
    return en, de


def toy_pairs(count: int, seed: int = TOY_TRAIN_SEED) -> Pairs:
    """``count`` sentence pairs of the generated toy language, the same for the same seed."""
    from tests.support.synthetic_mirror import sentence_pair

    rng = random.Random(seed)
    pairs = [sentence_pair(rng) for _ in range(count)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def train_spm(pairs: Pairs, root: Path) -> Path:
    import sentencepiece as spm

    en, de = pairs
    spm.SentencePieceTrainer.train(sentence_iterator=iter(en[:4000] + de[:4000]), model_prefix=str(root / "spm"),
                                   vocab_size=VOCAB_SIZE, model_type="bpe", character_coverage=1.0, pad_id=0,
                                   unk_id=1, bos_id=2, eos_id=3, num_threads=1, minloglevel=2)
    return root / "spm.model"


def train_tiny_model(pairs: Pairs, root: Path, steps: int = 300, batch_size: int = 48) -> dict:
    """Train on ``pairs`` and write ``root/average/{model.pt, model_config.json}`` (an ``average``
    output) and ``root/spm.model``; returns their paths and the config."""
    torch.set_flush_denormal(True)  # CPU training slows many-fold on denormals
    root.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same weights whatever the machine's core count
    try:
        return _train(pairs, root, steps, batch_size)
    finally:
        torch.set_num_threads(threads)


def _train(pairs: Pairs, root: Path, steps: int, batch_size: int) -> dict:
    import sentencepiece as spm

    spm_path = train_spm(pairs, root)
    sp = spm.SentencePieceProcessor(model_file=str(spm_path))
    en, de = pairs
    data = [(s, t) for s, t in zip(sp.encode(en), sp.encode(de))
            if 0 < len(s) <= MAX_PIECES and 0 < len(t) <= MAX_PIECES]
    cfg = ModelConfig(vocab_size=sp.get_piece_size(), **MODEL)
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = make_optimizer(model)
    sched = make_scheduler(opt, d_model=cfg.d_model, warmup_steps=100, scale=LR_SCALE)
    rng = random.Random(0)
    model.train()
    for _ in range(steps):
        batch = rng.sample(data, batch_size)
        src = _pad([s + [cfg.eos_id] for s, _ in batch])
        tgt_in = _pad([[cfg.bos_id] + t for _, t in batch])
        tgt_out = _pad([t + [cfg.eos_id] for _, t in batch])
        logits = model.logits(model(src, tgt_in, NonPad()))
        loss, _ = label_smoothed_nll(logits, tgt_out[tgt_out.ne(0)], 0.1, reduction="mean")
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    out = root / "average"
    out.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), out / "model.pt")
    (out / "model_config.json").write_text(json.dumps(cfg.to_dict()))
    return {"model": str(out / "model.pt"), "model_dir": str(out), "model_config": cfg.to_dict(),
            "spm": str(spm_path), "final_loss": float(loss.detach())}


def _pad(rows: list[list[int]]) -> torch.Tensor:
    out = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out
