"""Beam search with this tree's model code against another commit's, in one run, as a ratio; with
--train, a training step instead.

For a change to the decoder (model/incremental.py, model/transformer.py, model/search.py): each
round decodes the same random sentences with the same random model (seeded) once per tree, each in
a fresh process on one torch thread, the trees alternating; it prints each tree's best time, the
ratio, and whether the hypotheses are the same (a digest of every token id).
With --train (a change to the layers): each round times the same training step (forward, loss,
backward; a batch of 64 random pairs of 20-40 pieces, d_model 256, 3+3 layers, 2 torch threads,
fp32, dropout 0.1 with a fixed seed), best of 5 steps, and compares the loss and every gradient
(a digest of their bits).

    .venv/bin/python benchmarks/decode_step_ab.py --before HEAD~1 [--rounds 3] [--d-k 16 --d-v 64]
    .venv/bin/python benchmarks/decode_step_ab.py --before HEAD~1 --train [--rounds 6]

The other commit is checked out with `git worktree` into a temporary folder, removed at the end.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Run in a child process with the tree's root first on sys.path: prints "<best seconds> <digest>".
CHILD = r"""
import hashlib, sys, time
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(1)
from model import ModelConfig, Transformer, beam_search
d_k, d_v, sentences, batch, beam = (int(a) for a in sys.argv[2:7])
cfg = ModelConfig(vocab_size=8000, d_model=128, d_ff=512, n_heads=4, d_k=d_k or None, d_v=d_v or None,
                  n_encoder_layers=2, n_decoder_layers=2, max_positions=256)
torch.manual_seed(0)
model = Transformer(cfg).eval()
g = torch.Generator().manual_seed(1)
srcs = [torch.randint(4, 8000, (int(n),), generator=g).tolist() + [3]
        for n in torch.randint(8, 40, (sentences,), generator=g)]
def padded(rows):
    S = max(map(len, rows))
    return torch.tensor([r + [0] * (S - len(r)) for r in rows])
best, out = float("inf"), []
for _ in range(3):
    t, out = time.perf_counter(), []
    with torch.no_grad():
        for i in range(0, sentences, batch):
            out += beam_search(model, padded(srcs[i:i + batch]), beam_size=beam, max_len_b=10)
    best = min(best, time.perf_counter() - t)
print(f"{best:.3f} {hashlib.sha256(repr(out).encode()).hexdigest()[:12]}")
"""

# The training step's child: prints "<best seconds> <digest of the loss and every gradient>".
TRAIN_CHILD = r"""
import hashlib, sys, time
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(2)
from model import ModelConfig, Transformer
cfg = ModelConfig(vocab_size=8000, d_model=256, d_ff=1024, n_heads=4, n_encoder_layers=3, n_decoder_layers=3,
                  dropout=0.1, max_positions=256)
torch.manual_seed(0)
model = Transformer(cfg).train()
g = torch.Generator().manual_seed(1)
def batch(lengths):
    rows = [torch.randint(4, 8000, (int(n),), generator=g).tolist() for n in lengths]
    T = max(map(len, rows))
    return torch.tensor([r + [0] * (T - len(r)) for r in rows])
src, tgt = batch(torch.randint(20, 40, (64,), generator=g)), batch(torch.randint(20, 41, (64,), generator=g))
tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
best = float("inf")
for _ in range(5):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(2)  # the same dropout masks in every step and tree
    t = time.perf_counter()
    logits = model.logits(model(src, tgt_in))
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=0,
                                             label_smoothing=0.1)
    loss.backward()
    best = min(best, time.perf_counter() - t)
h = hashlib.sha256(loss.detach().numpy().tobytes())
for name, p in sorted(model.named_parameters()):
    h.update(name.encode() + p.grad.numpy().tobytes())
print(f"{best:.4f} {h.hexdigest()[:12]}")
"""


def run(tree: Path, args: argparse.Namespace) -> tuple[float, str]:
    if args.train:
        cmd = [sys.executable, "-c", TRAIN_CHILD, str(tree)]
    else:
        cmd = [sys.executable, "-c", CHILD, str(tree), str(args.d_k), str(args.d_v), str(args.sentences),
               str(args.batch), str(args.beam)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()
    return float(out[0]), out[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="the commit to compare this tree against")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--d-k", type=int, default=0, help="per-head query/key width (0: d_model / h)")
    p.add_argument("--d-v", type=int, default=0, help="per-head value width (0: d_model / h)")
    p.add_argument("--sentences", type=int, default=96)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--train", action="store_true", help="time a training step instead of beam search")
    args = p.parse_args()
    what = "loss and gradients (bits)" if args.train else "hypotheses"
    with tempfile.TemporaryDirectory(prefix="decode-ab-") as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(before), args.before],
                       check=True)
        try:
            times: dict[str, list[float]] = {"before": [], "after": []}
            digests: dict[str, set[str]] = {"before": set(), "after": set()}
            for _ in range(args.rounds):
                for name, tree in (("before", before), ("after", REPO)):
                    seconds, digest = run(tree, args)
                    times[name].append(seconds)
                    digests[name].add(digest)
                    print(f"{name:6s} {seconds:.4f} s  {what} {digest}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(before)], check=True)
    b, a = min(times["before"]), min(times["after"])
    print(f"best of {args.rounds}: before ({args.before}) {b:.4f} s, after (this tree) {a:.4f} s, "
          f"after/before {a / b:.3f}x; the same {what}: {digests['before'] == digests['after']}")


if __name__ == "__main__":
    main()
