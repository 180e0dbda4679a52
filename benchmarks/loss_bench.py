"""The output projection + label-smoothed loss: unfused (bf16 logits of every position, then the
loss in one fp32 chunk) vs fused (`model.linear_label_smoothed_nll`, row
chunks of `GPU_CHUNK_ELEMENTS` logits), forward + backward, on this CPU at a GPU micro-batch's size.

    .venv/bin/python benchmarks/loss_bench.py [--tokens 4096] [--vocab 37000] [--d-model 512]

Peak memory is each variant's own process's peak resident memory (ru_maxrss) above what it held
once its inputs existed: what the step adds. Time is informative only (a CPU, not the GPU this
path is for). The loss and gradients of the two are compared too. Run it alone.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def child(variant: str, tokens: int, vocab: int, d: int) -> dict:
    import torch

    import model.training as model_training

    torch.manual_seed(0)
    hidden = (torch.randn(tokens, d) * 2).requires_grad_()  # fp32: the last LayerNorm's output under autocast
    weight = (torch.randn(vocab, d) * d ** -0.5).requires_grad_()
    target = torch.randint(4, vocab, (tokens,))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if variant == "before":
        logits = hidden.to(torch.bfloat16) @ weight.to(torch.bfloat16).t()  # (M, V) bf16, as autocast's linear
        # The GPU path: the whole (M, V) in one chunk.
        loss, nll = model_training.label_smoothed_nll(logits, target, 0.1, 0, cpu_chunk_elements=logits.numel())
    else:
        loss, nll = model_training.linear_label_smoothed_nll(hidden, weight, target, 0.1, 0, torch.bfloat16)
    loss.backward()
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"variant": variant, "peak_mib": (peak - base) / 1024, "seconds": wall, "loss": float(loss),
            "grad_hidden_norm": float(hidden.grad.norm()), "grad_weight_norm": float(weight.grad.norm())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=37000)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--child", default="")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.vocab, args.d_model)))
        return
    rows = {}
    for variant in ("before", "fused"):
        out = subprocess.run([sys.executable, __file__, "--child", variant, "--tokens", str(args.tokens), "--vocab",
                              str(args.vocab), "--d-model", str(args.d_model)], capture_output=True, text=True,
                             check=True).stdout
        rows[variant] = json.loads(out.strip().splitlines()[-1])
    b, f = rows["before"], rows["fused"]
    mv = args.tokens * args.vocab * 4 / 2**20
    print(f"projection + loss, fwd + bwd, M = {args.tokens} tokens, V = {args.vocab}, d = {args.d_model} "
          f"(M x V in fp32 = {mv:,.0f} MiB)")
    print(f"{'':28}{'before':>12}{'fused':>12}{'fused/before':>14}")
    print(f"{'peak memory added (MiB)':28}{b['peak_mib']:12,.0f}{f['peak_mib']:12,.0f}{f['peak_mib'] / b['peak_mib']:14.2f}")
    print(f"{'seconds on this CPU':28}{b['seconds']:12.2f}{f['seconds']:12.2f}{f['seconds'] / b['seconds']:14.2f}")
    print(f"{'loss (sum)':28}{b['loss']:12.1f}{f['loss']:12.1f}{f['loss'] / b['loss']:14.5f}")
    for k in ("grad_hidden_norm", "grad_weight_norm"):
        print(f"{k:28}{b[k]:12.4f}{f[k]:12.4f}{f[k] / b[k]:14.5f}")


if __name__ == "__main__":
    main()
