"""Beam search with this tree's model code against another commit's, in one run, as a ratio.

For a change to the decoder (model/incremental.py, model/transformer.py, model/search.py): each
round decodes the same random sentences with the same random model (seeded) once per tree, each in
a fresh process on one torch thread, the trees alternating; it prints each tree's best time, the
ratio, and whether the hypotheses are the same (a digest of every token id).

    .venv/bin/python benchmarks/decode_step_ab.py --before HEAD~1 [--rounds 3] [--d-k 16 --d-v 64]

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


def run(tree: Path, args: argparse.Namespace) -> tuple[float, str]:
    out = subprocess.run([sys.executable, "-c", CHILD, str(tree), str(args.d_k), str(args.d_v),
                          str(args.sentences), str(args.batch), str(args.beam)],
                         check=True, capture_output=True, text=True).stdout.split()
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
    args = p.parse_args()
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
                    print(f"{name:6s} {seconds:.3f} s  hypotheses {digest}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(before)], check=True)
    b, a = min(times["before"]), min(times["after"])
    print(f"best of {args.rounds}: before ({args.before}) {b:.3f} s, after (this tree) {a:.3f} s, "
          f"after/before {a / b:.2f}x; the same hypotheses: {digests['before'] == digests['after']}")


if __name__ == "__main__":
    main()
